"""KvtierConnector: vLLM's KVConnectorBase_V1 on top of kvtier (see docs/vllm.md).

vLLM makes one instance in the scheduler (role SCHEDULER) and one in each worker (role
WORKER). This class only translates vLLM's calls; the work is in scheduler.py (lookups,
per-step plans) and worker.py (the store, layer-wise loads, background saves).

Call order per step: scheduler: get_num_new_matched_tokens -> update_state_after_alloc ->
build_connector_meta; worker: bind_connector_metadata -> start_load_kv ->
(wait_for_layer_load, save_kv_layer per attention layer) -> wait_for_save ->
get_finished -> get_block_ids_with_load_errors; scheduler: update_connector_output.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata, KVConnectorRole)

try:      # vLLM's per-source cache-hit metric (newer vLLM); without it the base class's behaviour stands
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    CacheHitSource = None

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import model_revision, parse_config
from kvtier.integrations.vllm.pages import KVSpec
from kvtier.integrations.vllm.plan import StepPlan
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


def _route_logs() -> None:
    """Show kvtier's connector messages where vLLM's own go (vLLM configures only "vllm.*")."""
    if not log.handlers:
        for h in logging.getLogger("vllm").handlers:
            log.addHandler(h)
        if log.handlers:
            log.setLevel(logging.INFO)
            log.propagate = False


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvtierHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start: where the worker's store answers lookups."""

    info: dict[str, Any] = field(default_factory=dict)


class KvtierConnector(KVConnectorBase_V1):
    """Loads cached prefixes from kvtier's tiers and saves new blocks to them."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _route_logs()
        self.cfg = parse_config(self._kv_transfer_config.kv_connector_extra_config)
        self.block_tokens = vllm_config.cache_config.block_size
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.cfg, self.block_tokens)
            tc = self._kv_transfer_config
            if self.cfg.failure_policy == "recompute" and tc.kv_load_failure_policy != "recompute":
                # kvtier is a cache: a block that fails verification (or was evicted since the
                # lookup) is a miss to recompute, not a reason to fail the request.
                log.info("kvtier: setting kv_load_failure_policy='recompute' (failure_policy='keep' to leave it)")
                tc.kv_load_failure_policy = "recompute"
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            pp = get_pp_group()
            if pp.world_size > 1:
                raise ConfigError("the kvtier connector does not support pipeline parallelism yet "
                                  "(pipeline_parallel_size must be 1)")
            tp = get_tp_group()
            mc = vllm_config.model_config
            self._worker = WorkerSide(self.cfg, mc.model, model_revision(mc.model, mc.revision),
                                      tp.rank_in_group, tp.world_size,
                                      sync_failures=self._sync_failures if tp.world_size > 1 else None)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load really waits per layer: it must run between graph pieces.
        return True

    # A best-effort cache: a save vLLM drops on preemption is only a future miss.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ================================ worker side ================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        kcc = self._kv_cache_config
        groups = kcc.kv_cache_groups
        if len(groups) != 1:
            raise ConfigError(f"the kvtier connector supports models with one KV cache group; this one has "
                              f"{len(groups)} (hybrid attention): run it without the connector")
        spec = groups[0].kv_cache_spec
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        ks = KVSpec(block_tokens=spec.block_size, num_blocks=kcc.num_blocks,
                    mla=isinstance(spec, MLAAttentionSpec), num_kv_heads=getattr(spec, "num_kv_heads", 1),
                    head_size=getattr(spec, "head_size", 0), cache_layout=str(getattr(kcc, "kv_cache_layout", "")))
        self._worker.register(kv_caches, ks, list(groups[0].layer_names))

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        info = self._worker.handshake() if self._worker is not None else None
        return KvtierHandshake(info) if info is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvtierMetadata):
            self._worker.ingest(connector_metadata.plan)

    def _plan(self) -> StepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KvtierMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if self._worker is not None and plan is not None:
            self._worker.start_load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        # A kvtier block holds every layer, so a block is saved once its last layer is
        # written: in wait_for_save, one gather per step (a side stream on a GPU).
        return

    def wait_for_save(self) -> None:
        plan = self._plan()
        if self._worker is not None and plan is not None:
            self._worker.end_step(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Saves copy the pages in the step that fills them, so vLLM frees a finished request's
        # pages at once, but for a last save planned after it finished (request_finished):
        # those requests are reported sent once their save has read the pages.
        if self._worker is None:
            return None, None
        self._worker.finished(finished_req_ids)
        return self._worker.sent() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    def _sync_failures(self, flags: list[int]) -> list[int]:
        """Elementwise OR of per-load failure flags across tensor-parallel ranks."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return t.tolist()

    # =============================== scheduler side ===============================
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._sched is not None:
            self._sched.set_workers([m.info for m in metadata.values() if isinstance(m, KvtierHandshake)])

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata({tp: m for (_, tp), m in metadata.items()})

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.match(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._sched.after_alloc(request, ids, num_external_tokens)

    if CacheHitSource is not None:
        def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
            """The tokens this request loads, by the kvtier tier each block comes from: host
            memory (HOST), disk (DISK), other kvtier nodes (P2P); EXTERNAL_UNSPECIFIED for what
            the lookup did not tell (host vs disk when the worker is in another process).
            vLLM calls it after update_state_after_alloc, when it records its prefix-cache stats."""
            if num_external_tokens <= 0 or self._sched is None:
                return {}
            try:
                split = self._sched.hit_sources(request, num_external_tokens)
            except Exception as e:     # statistics: never an error in vLLM's scheduler
                log.warning("kvtier: cannot tell the tiers of request %s's cached tokens: %s",
                            getattr(request, "request_id", "?"), e)
                return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
            return {CacheHitSource(k): v for k, v in split.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        state = getattr(scheduler_output, "kv_connector_block_state", None)

        def block_ids_of(req_id: str) -> list[int]:
            got = state.get_block_ids(req_id) if state is not None else None
            if got is None:
                assert self._kv_cache_manager is not None
                got = self._kv_cache_manager.get_blocks(req_id).get_block_ids()
            return list(got[0])

        return KvtierMetadata(self._sched.build(scheduler_output, block_ids_of))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.on_output(connector_output.invalid_block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        return self._sched.finish(request, block_ids), None
