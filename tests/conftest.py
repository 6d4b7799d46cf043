import os

# Multi-token forwards on 2 cores slow down 10-100x with OpenMP spin-waiting; must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
