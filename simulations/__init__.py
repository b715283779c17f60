"""Top layer: what drives the apps or replaces Flower -- the fast engine (``simulations.engine``),
the real Flower CLI and deployment helpers (``simulations.flower``), the in-process grid
(``simulations.loopback``), the experiment runner, summaries, plots and the demo."""
