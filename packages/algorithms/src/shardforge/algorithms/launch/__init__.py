"""Launchers: torchrun relaunch (``torchrun``), multi-node rendezvous (``multinode``), ranks as Ray actors (``ray``)."""
