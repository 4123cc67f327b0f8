"""What the tools share about a workload: the trace (``trace``), its statistics (``stats``) and the
hit-rate and load bounds no policy or router can beat (``bounds``).

``bench``, ``simulate`` and ``serve_ray`` import from here; nothing here imports them.
"""
