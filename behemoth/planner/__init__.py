"""The planner's ground: what a plan needs (memory.py: model-state bytes per rank at each ZeRO stage) and whether it
can run at all (feasibility.py: every reason it cannot). Pure functions of shapes and numbers: no processes."""
