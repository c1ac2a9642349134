"""Triton kernels for the MSA verify step, and the chooser between them and the torch references.

Importing this package never imports `triton`; the kernel modules (`index_select`,
`sparse_verify`, `verify_step`, `dense_verify`, `kv_lens_update`, `kv_write`, `merge`) do, and are loaded only when
`backend_report()` / `use_triton()` say they can run. FlashInfer's MSA ops (`flashinfer_msa`) are
imported only when a call is eligible for them; `kernel_table` holds the measured choice.

No kernel module may share a name with an exported dispatcher: importing a submodule rebinds the
package attribute of the same name, which would replace the function with the module.
"""
from __future__ import annotations

from ._common import KernelInputError, KernelTooLargeError, triton_available
from .backend import (
    KernelBackendError,
    backend_report,
    check_backend,
    dense_attention,
    on_update_kv_lens,
    select_blocks_paged,
    sparse_attention,
    sparse_layer_attention,
    use_triton,
    write_step_kv,
)

__all__ = [
    "KernelBackendError",
    "KernelInputError",
    "KernelTooLargeError",
    "backend_report",
    "check_backend",
    "dense_attention",
    "on_update_kv_lens",
    "select_blocks_paged",
    "sparse_attention",
    "sparse_layer_attention",
    "triton_available",
    "use_triton",
    "write_step_kv",
]
