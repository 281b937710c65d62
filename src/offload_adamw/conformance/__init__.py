"""Is my optimizer still AdamW? The conformance checker (:mod:`offload_adamw.conformance.checker`)."""

from offload_adamw.conformance.checker import (
    CLAUSES,
    CandidateLoadError,
    ClauseResult,
    HyperMapping,
    Report,
    UsageError,
    check,
    load_candidate,
    parse_dtype,
)

__all__ = ["CLAUSES", "CandidateLoadError", "ClauseResult", "HyperMapping", "Report", "UsageError", "check", "load_candidate",
           "parse_dtype"]
