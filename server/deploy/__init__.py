"""Deployment on separate hosts: scripts (certificates, SuperLink, SuperNodes, submit) and
``cli_json``, the reader of ``flwr --format json`` output they share with simulations.flower
(whose ``deploy`` module drives the scripts on one machine). See docs/DEPLOY.md."""
