"""The pure math of the methods (PyTorch only: no flwr, no torch.distributed, nothing of the layers above).

The clipped-SGD step (``clipped_sgd``), one client's loop of local steps (``local_update``),
averaging and robust statistics (``averaging``, ``robust_statistics``), the schedule of lr and
clip (``schedule``), naive parallel clipping's server step (``parallel_clip_step``), EPISODE's
corrections (``episode_corrections``), the running mean of iterates (``iterate_average``),
which K of M clients train (``client_sampling``), the bound on an honest client's displacement
(``bound``), the rules for buffers (``buffers``), the step-weighted client metrics
(``client_metrics``) and the run's validated hyper-parameters and round settings (``settings``).
"""
