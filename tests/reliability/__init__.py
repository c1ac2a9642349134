"""Reliability suite: hostile inputs, fuzzed KV schedules, injected faults, bad files, soak."""
