"""The replicas of the simulated fleet, step by step as the engine schedules: bring-in, batches,
the host tier, and the events that drive them."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lora_guard.plugins.eviction import ResidentView, eviction_order
from lora_guard.simulate_costs import Costs

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class SimRequest:
    id: int
    time: float  # seconds
    adapter_id: str | None
    prompt_tokens: int
    new_tokens: int


@dataclass
class Outcome:
    request: SimRequest
    replica: str = ""
    hit: bool = False  # its adapter was resident on its replica when it arrived
    sent: float = 0.0  # when its client sent it
    first_token: float | None = None
    finish: float | None = None  # its last token, on its replica
    answered: float | None = None  # when its client has the answer
    computed: int = 0  # prompt tokens computed
    generated: int = 0
    needed_since: float | None = None  # since when it waits for its adapter (the engine's order)


@dataclass
class Seat:
    loaded_at: float
    last_used: float


@dataclass
class Replica:
    replica_id: str
    slots: int
    max_num_seqs: int
    costs: Costs
    quantum_s: float
    host_slots: int = 32
    max_batch_tokens: int = 2048
    resident: OrderedDict[str, Seat] = field(default_factory=OrderedDict)  # least recent first
    host: OrderedDict[str, None] = field(default_factory=OrderedDict)  # least recent first
    running: list[Outcome] = field(default_factory=list)  # admitted, in admission order
    waiting: list[Outcome] = field(default_factory=list)  # in arrival order
    reads: list[str] = field(default_factory=list)  # queued for the loader, the first being read
    stepping: bool = False
    retry_at: float | None = None  # when a seat's quantum ends, if a load waits for it
    loads: int = 0  # pool writes (the engine's adapter loads)
    disk_reads: int = 0

    @property
    def queue_len(self) -> int:
        return len(self.running) + len(self.waiting)

    def free_seats(self) -> int:
        return self.slots - len(self.resident)

    def usable(self, outcome: Outcome) -> bool:
        return outcome.request.adapter_id is None or outcome.request.adapter_id in self.resident

    def start_with(self, resident: Sequence[str], host: Sequence[str]) -> None:
        """Start with ``resident`` in the pool (the last ones if they are more than the seats)
        and ``host`` in host memory beside them (the last ``host_slots`` of both)."""
        for adapter in [*host, *resident][-self.host_slots :]:
            self.host[adapter] = None
        for adapter in list(resident)[-self.slots :]:
            self.resident[adapter] = Seat(-self.quantum_s, -self.quantum_s)


class Events:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[float], None]]] = []
        self.count = 0

    def at(self, time: float, action: Callable[[float], None]) -> None:
        self.count += 1
        heapq.heappush(self.heap, (time, self.count, action))

    def run(self) -> None:
        while self.heap:
            time, _, action = heapq.heappop(self.heap)
            action(time)


class Fleet:
    """The replicas and what happens in them, one engine step at a time; ``finished`` is told
    of each request as its last token comes."""

    def __init__(
        self,
        replicas: list[Replica],
        events: Events,
        finished: Callable[[Outcome, float], None] = lambda _o, _t: None,
    ) -> None:
        self.replicas, self.events, self.finished = replicas, events, finished

    def arrive(self, replica: Replica, outcome: Outcome, now: float) -> None:
        outcome.replica = replica.replica_id
        outcome.hit = replica.usable(outcome)
        replica.waiting.append(outcome)
        self._wake(replica, now)

    def _wake(self, replica: Replica, now: float) -> None:
        """Form and start the next step, unless one is running or nothing can run."""
        if replica.stepping:
            return
        write_ms = self._bring_in(replica, now)
        batch, prefill = self._batch(replica)
        # Used in the batch's order, as the engine marks them (the last the most recent).
        adapters = list(
            dict.fromkeys(
                o.request.adapter_id for o, _ in batch if o.request.adapter_id is not None
            )
        )
        for adapter in adapters:
            replica.resident[adapter].last_used = now
            replica.resident.move_to_end(adapter)
        if not batch and not write_ms:
            self._retry_later(replica, now)
            return  # idle until an arrival, a finished read or a quantum's end
        duration = write_ms
        if batch:
            duration += replica.costs.step(len(batch), len(adapters), prefill)
        replica.stepping = True
        self.events.at(now + duration / 1000, lambda t: self._stepped(replica, batch, t))

    def _retry_later(self, replica: Replica, now: float) -> None:
        """An idle replica whose parked or waiting requests need a seat that no adapter may
        leave yet tries again when the first quantum ends (the engine polls each step)."""
        if any(not replica.usable(o) for o in (*replica.running, *replica.waiting)):
            first = min((s.loaded_at for s in replica.resident.values()), default=now)
            at = max(first + replica.quantum_s, now)
            if at > now and (replica.retry_at is None or replica.retry_at > at):
                replica.retry_at = at
                self.events.at(at, lambda t: self._retry(replica, t))

    def _retry(self, replica: Replica, now: float) -> None:
        replica.retry_at = None
        self._wake(replica, now)

    def _bring_in(self, replica: Replica, now: float) -> float:
        """Load the adapters waiting and parked requests need, oldest need first; returns the
        milliseconds of pool writes this step makes."""
        needing = []
        for o in (*replica.running, *replica.waiting):
            if not replica.usable(o):
                if o.needed_since is None:
                    o.needed_since = now
                needing.append(o)
        needing.sort(key=lambda o: o.needed_since or now)
        demand = {o.request.adapter_id for o in (*replica.running, *replica.waiting)}
        write_ms, tried = 0.0, set()
        for outcome in needing:
            adapter = outcome.request.adapter_id
            assert adapter is not None
            if adapter in tried:
                continue
            tried.add(adapter)
            if adapter not in replica.host:
                self._read(replica, adapter, now)
                continue
            if len(replica.resident) >= replica.slots and not self._evict(replica, demand, now):
                continue
            replica.host.move_to_end(adapter)
            replica.resident[adapter] = Seat(now, now)
            replica.loads += 1
            write_ms += replica.costs.write()
        return write_ms

    def _evict(self, replica: Replica, demand: Collection[str | None], now: float) -> bool:
        """Free a seat with the engine's own choice (``plugins.eviction.eviction_order``); False
        when none may leave."""
        views = [
            ResidentView(a, seat.last_used, seat.loaded_at, needed=a in demand)
            for a, seat in replica.resident.items()
        ]
        order = eviction_order(views, now, replica.quantum_s)
        if not order:
            return False
        del replica.resident[order[0]]
        return True

    def _read(self, replica: Replica, adapter: str, now: float) -> None:
        if adapter in replica.reads:
            return
        replica.reads.append(adapter)
        if len(replica.reads) == 1:
            self.events.at(now + replica.costs.read() / 1000, lambda t: self._read_done(replica, t))

    def _read_done(self, replica: Replica, now: float) -> None:
        adapter = replica.reads.pop(0)
        replica.disk_reads += 1
        replica.host[adapter] = None
        replica.host.move_to_end(adapter)
        while len(replica.host) > replica.host_slots:
            replica.host.popitem(last=False)
        if replica.reads:
            self.events.at(now + replica.costs.read() / 1000, lambda t: self._read_done(replica, t))
        self._wake(replica, now)

    def _batch(self, replica: Replica) -> tuple[list[tuple[Outcome, int]], int]:
        """The step's sequences with their new tokens, and its prefill tokens."""
        budget, batch, prefill = replica.max_batch_tokens, [], 0
        for outcome in replica.running:
            if budget <= 0:
                break
            if replica.usable(outcome):
                n = min(_uncomputed(outcome), budget)
                batch.append((outcome, n))
                budget -= n
        admitted: list[Outcome] = []
        for outcome in replica.waiting:
            if budget <= 0 or len(replica.running) + len(admitted) >= replica.max_num_seqs:
                break
            if replica.usable(outcome):
                n = min(_uncomputed(outcome), budget)
                batch.append((outcome, n))
                admitted.append(outcome)
                budget -= n
        if admitted:
            taken = {id(o) for o in admitted}
            replica.waiting = [o for o in replica.waiting if id(o) not in taken]
            replica.running.extend(admitted)
        for outcome, n in batch:
            outcome.needed_since = None
            if outcome.computed < outcome.request.prompt_tokens:
                prefill += n
        return batch, prefill

    def _stepped(self, replica: Replica, batch: list[tuple[Outcome, int]], now: float) -> None:
        replica.stepping = False
        for outcome, n in batch:
            prompt = outcome.request.prompt_tokens
            if outcome.computed < prompt:
                outcome.computed += n
                if outcome.computed < prompt:
                    continue  # a chunk of its prompt: no token yet
            outcome.generated += 1
            if outcome.first_token is None:
                outcome.first_token = now
            if outcome.generated >= outcome.request.new_tokens:
                outcome.finish = now
                self.finished(outcome, now)
        replica.running = [o for o in replica.running if o.finish is None]
        self._wake(replica, now)


def _uncomputed(outcome: Outcome) -> int:
    return max(outcome.request.prompt_tokens - outcome.computed, 1)
