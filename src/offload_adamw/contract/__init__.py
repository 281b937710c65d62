"""The AdamW contract in code (docs/contract.md): the reference, the state's keys and its byte bill.

Nothing here imports torch: the planner and the checker's report use it on machines without torch.
"""
