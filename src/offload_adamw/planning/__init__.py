"""What fits where, and how fast a step can be: the planner and the host bandwidth probe."""
