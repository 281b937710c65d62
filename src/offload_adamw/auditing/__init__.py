"""An audit of an optimizer set-up: what is missing, duplicated, decayed, narrowed, and how much decay a run applies."""

from offload_adamw.auditing.audit import AuditFinding, AuditReport, audit, audit_state_dict
from offload_adamw.auditing.inputs import AuditInputError, audit_file

__all__ = ["AuditFinding", "AuditReport", "audit", "audit_state_dict", "AuditInputError", "audit_file"]
