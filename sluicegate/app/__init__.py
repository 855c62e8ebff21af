"""The entry points: the command line, the demo and the embedded stack.

The top layer: the only code that may import ``flows/`` (it starts things); nothing imports it.
"""
