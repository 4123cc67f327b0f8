"""Read-only views of the engine that hooks receive. Policies decide from these; they never
reach into the engine's own objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: The span of the state's load counts (``cold_loads_in_window``, ``evicting_loads``).
LOAD_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class RequestView:
    """One request as a policy sees it."""

    request_id: str
    adapter_id: str | None
    tenant_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float
    waited_steps: int
    cache_salt: str | None = None
    max_new_tokens: int = 0
    # the engine's clock (``EngineConfig.clock``, ``clock.monotonic`` unless given) at its arrival,
    # first token and end; None before
    first_token_time: float | None = None
    finished_time: float | None = None
    held_s: float = 0.0  # seconds a policy has left it out of the batch (batch form) so far

    @property
    def steps_to_end(self) -> int:
        """Steps until it ends at its ``max_new_tokens``, one token a step (with no output yet,
        one step more for its prompt)."""
        return max(self.max_new_tokens - self.num_output_tokens, 0) + (self.num_output_tokens == 0)


def steps_left(running: Iterable[RequestView]) -> dict[str, int]:
    """For each adapter of ``running``, the steps until its last request ends
    (:attr:`RequestView.steps_to_end`)."""
    left: dict[str, int] = {}
    for r in running:
        if r.adapter_id is not None:
            left[r.adapter_id] = max(left.get(r.adapter_id, 0), r.steps_to_end)
    return left


@dataclass(frozen=True, slots=True)
class SlotView:
    """One seat of the adapter pool (``max_loras`` seats): the adapter in it (None when free),
    how many running requests use that adapter, when a step last computed with it, whether
    the engine would let it leave now (not pinned, its residency quantum over or no request
    needing it), the pool pages it holds and when it was loaded. Residency is per step: a
    running request whose adapter leaves waits, parked."""

    slot: int
    adapter_id: str | None
    refs: int
    last_used: float
    evictable: bool = True
    pages: int = 0
    loaded_at: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineState:
    """The engine between two steps.

    :param step: steps run so far.
    :param now: the engine's clock when the view was taken.
    :param slots: every device slot.
    :param host_adapters: adapters held in host memory, least recently used first.
    :param loading: adapters being read from disk.
    :param memory_watermark: share of the cache pool in use (KV blocks and adapter pages), 0 to 1.
    :param num_waiting: requests waiting to start.
    :param num_running: requests running.
    :param registered: every adapter id the engine knows.
    :param waiting_adapters: adapter ids of the waiting requests (with repeats).
    :param running_adapters: adapter ids of the running requests (with repeats).
    :param heat: requests per adapter that arrived in the heat window (``heat_window_s``,
        default 60 s).
    :param tenant_heat: the same per ``(tenant_id, adapter_id)``.
    :param pinned: adapters the engine keeps resident once loaded (``pin``, or the admin route).
    :param cold_loads_in_window: adapter reads from disk started in the last 60 s.
    :param evicting_loads: when each load of the last 60 s that evicted an adapter requests
        still needed happened (on the engine's clock, oldest first), counting loads for requests
        not yet running (a parked request's reload is paced by the residency quantum).
    :param num_preemptions: running requests preempted (KV pool full) since the engine started.
    :param kv_share: share of the cache pool held by KV blocks in use, 0 to 1.
    :param pool_bytes: the cache pool's bytes by kind: ``kv`` (blocks in use), ``adapter``
        (adapter pages) and ``free`` (free blocks, cached prefixes included).
    :param num_parked: running requests waiting for their adapter to come back into the pool.
    :param adapters_changed_on_disk: adapters read again because their files changed on disk
        since they were read, since the engine started.
    :param free_pages: pages of the cache pool free now (cached prefixes included).
    :param adapter_pages: pages each resident adapter takes in the pool, and each adapter a
        running or waiting request needs, once it is in host memory.
    :param pool_pages: pages of the whole cache pool (KV blocks and adapter pages).
    :param block_size: tokens of KV a page holds.
    :param adapter_ranks: the largest rank of each adapter in the pool or in host memory.
    :param steps_left: for each adapter running requests use, the steps until the last of them
        ends if each runs to its ``max_new_tokens`` (one token a step, a prompt not yet read one
        step more): when its seat frees without an eviction (:func:`steps_left`).
    :param reads_in_background: a cold adapter is read from disk beside the steps (the bundled
        engine's loader thread), so its requests cannot run until the read ends; False where
        the step that needs it reads it (inside vLLM).
    """

    step: int
    now: float
    slots: tuple[SlotView, ...]
    host_adapters: tuple[str, ...]
    loading: frozenset[str]
    memory_watermark: float
    num_waiting: int
    num_running: int
    registered: frozenset[str] = field(default_factory=frozenset)
    waiting_adapters: tuple[str, ...] = ()
    running_adapters: tuple[str, ...] = ()
    heat: Mapping[str, int] = field(default_factory=dict)
    tenant_heat: Mapping[tuple[str, str], int] = field(default_factory=dict)
    pinned: frozenset[str] = frozenset()
    cold_loads_in_window: int = 0
    evicting_loads: tuple[float, ...] = ()
    num_preemptions: int = 0
    kv_share: float = 0.0
    pool_bytes: Mapping[str, int] = field(default_factory=dict)
    num_parked: int = 0
    adapters_changed_on_disk: int = 0
    free_pages: int = 0
    adapter_pages: Mapping[str, int] = field(default_factory=dict)
    pool_pages: int = 0
    block_size: int = 16
    adapter_ranks: Mapping[str, int] = field(default_factory=dict)
    reads_in_background: bool = True
    steps_left: Mapping[str, int] = field(default_factory=dict)

    def slot_of(self, adapter_id: str) -> int | None:
        for view in self.slots:
            if view.adapter_id == adapter_id:
                return view.slot
        return None

    @property
    def free_slots(self) -> tuple[int, ...]:
        return tuple(v.slot for v in self.slots if v.adapter_id is None)

    @property
    def idle_slots(self) -> tuple[int, ...]:
        """Seats free or holding an adapter that no running request uses."""
        return tuple(v.slot for v in self.slots if v.refs == 0)

    @property
    def evictable_slots(self) -> tuple[int, ...]:
        """Seats free or holding an adapter the engine would let leave now."""
        return tuple(v.slot for v in self.slots if v.adapter_id is None or v.evictable)
