"""lora-guard replicas behind Ray Serve (``pip install 'lora-guard[ray]'``).

``ranking`` holds the adapter-affinity ranking of replicas, shared by the Ray request router and
``lora-guard simulate``; it imports nothing of Ray.
"""
