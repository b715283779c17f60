"""Test-wide settings: one torch thread (CI has 2 cores shared by several processes; more
threads make the small models here slower, not faster), inherited by subprocesses too."""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
