"""What fits where, and how fast a step can be: the planner on plain numbers."""
