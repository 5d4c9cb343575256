"""The I/O plane: lower-tier byte work outside the engine's interpreter (`plane.WorkerPlane`,
its worker program `worker.py`)."""
