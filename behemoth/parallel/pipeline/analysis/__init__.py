"""The pipeline's analysis tools, pure functions of schedules: the timeline simulator (also the runtime's model of
when messages exist), the validator and the NCCL rendezvous model that prove a schedule runs, measured bubbles
from real step traces, grids and Gantt charts, and the `behemoth schedule` report."""
