"""Deployment on separate hosts: scripts (certificates, SuperLink, SuperNodes, submit) and
``local``, which drives them on one machine (tests, demos). See docs/DEPLOY.md."""
