"""The user's parts by name: losses, optimizers, metrics, numeric precision and learning-rate scaling.

Each module turns what the user passed (a name, an object, a factory) into the object training uses, with its checks.
"""
