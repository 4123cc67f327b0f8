"""The demo, in one room: the demo model and its seeded adapters (``model``, ``adapters``), the
persona adapters and how they are trained (``personas``, ``training``), the manifest that says where
each came from (``manifest``), where they are kept (``paths``), and the tiny checkpoints the tests
build (``testing``).
"""
