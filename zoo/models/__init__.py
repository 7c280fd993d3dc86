"""Recurrent architectures: one file per architecture, each registered in :mod:`zoo.registry`."""
