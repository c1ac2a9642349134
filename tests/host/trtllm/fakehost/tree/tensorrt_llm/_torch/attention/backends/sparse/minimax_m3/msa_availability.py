AVAILABLE = True


def ensure_msa_available() -> None:
    if not AVAILABLE:
        raise RuntimeError("MSA needs SM100 and fmha_sm100")
