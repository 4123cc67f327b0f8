"""``lora-guard simulate``: many replicas and many adapters, routers compared on one trace.

A discrete-event model of engine replicas behind a router, step by step as the engine schedules
(``engine/scheduler.py``, ``engine/lora/residency.py``). Each step first brings in the adapters
that waiting and parked requests need, the oldest need first: an adapter in host memory is
written into the pool during the step (a free seat, else the least recently used adapter no
request needs, else the one whose residency quantum is over); one on disk is read on the loader
thread, one at a time, into host memory (``host_slots`` adapters, LRU). Then running requests
whose adapter is resident get their next tokens (parked ones keep their place), and waiting ones
whose adapter is resident are admitted while ``max_num_seqs`` and the token budget allow.

A step costs a fixed part, a part per sequence, a part per MiB of adapter weights the batch
reads and a part per prompt token it prefills, plus the pool writes of its loads (``Costs``,
measured on the engine by ``lora-guard simulate --calibrate``). Routers see the replicas as a Ray
router does: queue lengths at once, resident adapters as last pushed (every ``stats_period_s``;
with ``stats_tick_s``, as Ray Serve's controller polls each replica). Clients send each request
at its time (open loop) or, with ``clients``, one after another (closed loop), each request
spending ``overhead_ms`` outside the engine (HTTP, the router, the hops).

Routers: ``lora-guard`` (``serve_ray.ranking``: affinity, room to load, spread, reserved loads),
``ray-multiplex`` (Ray Serve's multiplexed ranking: replicas that report the model, then those with
the fewest models, power of two choices within a rank) and ``power-of-two`` (no affinity).

Not modelled: the policies (the replicas decide as the engine does with none asked: its own
eviction order, ``plugins.eviction.eviction_order``, which lets an adapter requests still need
leave once its quantum is over, where the ``lru`` policy takes only adapters no running request
uses), the KV pool's size (no preemption), the prefix cache. Questions about one replica (its
policies, its pool) are virtual time's (``lora_guard.bench.virtual_time``), which runs the engine
itself on a virtual clock.

Its parts: ``fleet`` (the replicas and the events that drive them), ``routers``, ``run`` (one
simulation and its result), ``command`` (the command line).
"""

from lora_guard.simulate.command import main
from lora_guard.simulate.fleet import Replica, SimRequest
from lora_guard.simulate.routers import ROUTERS
from lora_guard.simulate.run import (
    SimResult,
    make_sim_trace,
    replica_capacity,
    sim_requests,
    simulate,
)

__all__ = [
    "ROUTERS",
    "Replica",
    "SimRequest",
    "SimResult",
    "main",
    "make_sim_trace",
    "replica_capacity",
    "sim_requests",
    "simulate",
]
