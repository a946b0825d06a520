"""Weight push from the trainer ranks to inference servers that speak SGLang's protocol.

Two paths:

- **distributed**: rank 0 and every server form a weight-update group, built as SGLang builds it
  (see nodes/common/weight_group.py; rank 0 hosts the store, server ``i`` joins as ranks
  ``rank_offset + tp_rank``). A flattened bucket travels as its bytes (uint8), as SGLang
  receives it.
  Every rank hands its shards of a bucket to rank 0 (shared memory on rank 0's host, else
  point-to-point sends; collective; see gather.py);
  rank 0 announces each bucket with ``/update_weights_from_distributed`` to every server and
  broadcasts it, while all ranks already gather the next bucket (one bucket in flight).
- **tensor**: the same buckets, handed over by reference with ``/update_weights_from_tensor``
  (nodes/common/tensor_ipc.py): on a GPU a CUDA IPC handle to rank 0's bucket buffer, which the server
  copies from on the GPU; on CPU a shared-memory copy of it. For servers on rank 0's host; on
  rank 0's own GPU, where a group has to use gloo (NCCL refuses two ranks on one GPU), it is the
  fast way: no copy through host memory (bench/gpu_push.py; bench/RESULTS.md, "GPU check").
- **disk**: the full state dict is saved as safetensors and every server is asked to
  ``/update_weights_from_disk``.

Under LoRA every path sends merged weights under the base model's names (nodes/trainer/lora.py):
the servers load them as they load a full fine-tune's. With ``[trainer.lora] push = "adapter"`` a
push sends the adapter alone instead: every rank all-gathers it (collective), rank 0 writes it
as a PEFT folder under ``disk_dir`` while the servers pause, each server loads it with
``/load_lora_adapter`` as ``<name>-v<version>`` (:func:`protocols.http.sglang.lora_name`), and its
``weight_version`` is set with ``/update_weight_version``; the rollout client names that adapter
in every ``/generate`` it posts from then on. Before the pause, versions older than the
``keep`` newest are unloaded (SGLang's unload waits for the requests that still use one, so it
must not run while they are held by a pause).

Around either: optional ``/pause_generation`` (abort | retract | in_place) and
``/continue_generation``, optional ``/begin_weight_update`` ... ``/end_weight_update`` (SGLang
0.5.23 refuses distributed updates outside such a session), and the servers' ``weight_version``
set to the trainer's version. All methods are collective over the trainer's default group;
only rank 0 talks HTTP. HTTP calls run in a small thread pool so they overlap the broadcasts.
Every body is one of protocols/http/sglang.py's request models, checked as the server checks it.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal, cast

import httpx  # blocking calls from the push's threads; the rollout's wire (nodes/rollout/http1) is asyncio-only
import structlog
import torch
import torch.distributed as dist

from nodes.common.tensor_ipc import serialize_named_tensors
from nodes.common.trace import TRACE
from nodes.common.weight_group import (
    broadcast,
    destroy_weight_update_group,
    gpu_uuid,
    init_weight_update_group,
)
from nodes.trainer.config import LoraConfig, PushConfig
from nodes.trainer.disk_weights import prune_versions, write_version
from nodes.trainer.gather import ParamGatherer
from nodes.trainer.lora import adapter_state, merge_state_dict, write_adapter
from protocols.http.sglang import (
    BeginWeightUpdateRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    PauseGenerationRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    lora_name,
    request_body,
)

__all__ = ["PushConfig", "WeightPushError", "WeightPusher", "flush_cache"]

log = structlog.get_logger(__name__)


class WeightPushError(RuntimeError):
    """A server refused or failed a step of the weight push (the message names server and step)."""


def flush_cache(cfg: PushConfig) -> bool:
    """Whether a push asks the servers to flush their prefix cache (see ``PushConfig.flush_cache``).

    Raises ``ValueError`` for ``flush_cache=True`` with ``pause_mode`` ``in_place`` or ``None``:
    requests still run during such a push, and SGLang answers the update with a failure after the
    weights are loaded ("cache was not flushed because requests are still running").
    """
    allowed = cfg.pause_mode in ("abort", "retract")
    if cfg.flush_cache is None:
        return allowed
    if cfg.flush_cache and not allowed:
        raise ValueError(
            f"trainer.push.flush_cache=true cannot be used with pause_mode={cfg.pause_mode!r}: requests "
            "keep running through such a push and SGLang refuses to flush then. Use pause_mode "
            "'retract' or 'abort', or flush_cache=false (or leave it unset)."
        )
    return bool(cfg.flush_cache)


# the requests that put a server back after a push (see WeightPusher._prepare), by route
_UNDO = {"/continue_generation": ContinueGenerationRequest, "/end_weight_update": EndWeightUpdateRequest}


def _in_thread(fn: Callable[..., Any], **kwargs: Any) -> Future:
    """``fn(**kwargs)`` in a daemon thread of its own; its future. (A pool's thread would stay taken
    for as long as ``fn`` blocks, and the call may be left to time out.)"""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(**kwargs))
        except BaseException as e:  # the call's outcome, whatever it is, belongs to the future
            fut.set_exception(e)

    threading.Thread(target=run, name=f"weight-push-{fn.__name__}", daemon=True).start()
    return fut


def _finished(work: Any) -> Future:
    """A future set when the collective ``work`` ends (with its error, if it failed)."""
    fut: Future = Future()

    def settle(done: Any) -> None:
        try:
            done.value()
        except BaseException as e:  # the call's outcome, whatever it is, belongs to the future
            fut.set_exception(e)
        else:
            fut.set_result(None)

    work.get_future().add_done_callback(settle)
    return fut


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WeightPusher:
    """One rank's side of the weight push; build it on every rank with the same config. With
    ``lora.push == "adapter"`` (and LoRA enabled) pushes send the adapter alone."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: PushConfig,
        model_config_dir: str | None = None,
        lora: LoraConfig | None = None,
    ):
        flush_cache(cfg)  # refuses a combination SGLang would fail mid-push
        self.model, self.cfg = model, cfg
        self.lora = lora if lora is not None and lora.enabled and lora.push == "adapter" else None
        self._adapters: list[str] = []  # the adapter names this pusher loaded, oldest first
        self.model_config_dir = model_config_dir
        self.rank = dist.get_rank()
        self.device = next(iter(model.parameters())).device
        # the group's backend; under "auto" connect() picks gloo when a server shares our GPU
        self.backend = (
            cfg.backend if cfg.backend != "auto" else ("nccl" if self.device.type == "cuda" else "gloo")
        )
        self.urls: list[str] = []
        self.group: Any = None
        self.group_name = ""
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weight-push-http")
        # auth: each call carries the key its route needs (cfg.keys: the servers' keys, if any)
        self._http = (
            httpx.Client(timeout=cfg.http_timeout_s, auth=cfg.keys or None) if self.rank == 0 else None
        )
        self.send_dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        self.gatherer: ParamGatherer | None = None  # built by the first distributed/tensor push
        self._tp: dict[str, int] = {}  # tensor: each server's tensor-parallel size (a payload per rank)
        self._staging: list[torch.Tensor | None] = [None, None]  # tensor on CPU: shared-memory copies
        self._timing: dict[str, float] = {}

    @property
    def _gathered(self) -> ParamGatherer:
        """The bucket gatherer (built by the first distributed or tensor push, before any use)."""
        assert self.gatherer is not None
        return self.gatherer

    # ---- HTTP (rank 0) -----------------------------------------------------------------------
    @property
    def _client(self) -> httpx.Client:
        """Rank 0's HTTP client (the other ranks make no calls)."""
        assert self._http is not None
        return self._http

    def _post(self, url: str, path: str, body: Any) -> Any:
        try:
            r = self._client.post(url + path, json=body)
        except httpx.HTTPError as e:  # the server named: a push talks to several
            raise WeightPushError(f"{url}{path} failed: {e!r}") from e
        try:
            data = r.json() if r.content else {}
        except json.JSONDecodeError:
            data = {"text": r.text}
        ok = r.status_code == 200 and (not isinstance(data, dict) or data.get("success", True) is not False)
        if not ok:
            raise WeightPushError(f"{url}{path} answered {r.status_code}: {r.text[:500]}")
        return data

    def _post_all(self, path: str, body: Any) -> list[Future]:
        return [self._pool.submit(self._post, url, path, body) for url in self.urls]

    def _wait(self, futures: list[Future]) -> list[Any]:
        return [f.result(timeout=self.cfg.http_timeout_s) for f in futures]

    def _while_servers_answer(self, collective: Future, posts: list[Future]) -> Any:
        """The result of ``collective`` (rank 0's side of a collective with the servers, bounded by
        ``group_timeout_s``), while watching ``posts``, the requests that tell the servers to take
        part. A server that refuses, or whose request fails, will not join
        in: its error is raised at once, instead of the collective waiting for it until then."""
        while not collective.done():
            for f in posts:
                if f.done() and f.exception() is not None:
                    raise cast(BaseException, f.exception())
            wait([collective, *(f for f in posts if not f.done())], return_when=FIRST_COMPLETED)
        return collective.result()

    # ---- group -------------------------------------------------------------------------------
    def connect(
        self, urls: list[str], master_address: str | None = None, master_port: int | None = None
    ) -> None:
        """Join the servers into a fresh weight-update group (rank 0 hosts it); collective.

        ``master_address``/``master_port`` come from the runtime's rendezvous reservation when
        the servers live on other hosts; by default rank 0 picks a free local port.
        """
        new = [u.rstrip("/") for u in urls]
        if self.cfg.method != "distributed" or self.rank != 0 or self.lora is not None:
            self.urls = new
            try:  # rank 0's failure raises there after the barrier, not while the others wait in it
                if self.cfg.method == "tensor" and self.rank == 0 and self.lora is None:
                    self._tp = {
                        u: int(self._client.get(u + "/server_info").json().get("tp_size", 1)) for u in new
                    }
            finally:
                dist.barrier()
            return
        if self.group is not None:
            self.disconnect()  # tells the old group's members to leave it (not the new list's)
        self.urls = new
        addr = master_address or self.cfg.master_address
        port = master_port or self.cfg.master_port or _free_port()
        self.group_name = self.cfg.group_name or f"rlactors-weights-{uuid.uuid4().hex[:8]}"
        infos = [self._client.get(u + "/server_info").json() for u in self.urls]
        tp = [int(info.get("tp_size", 1)) for info in infos]
        world = 1 + sum(tp)
        self.backend = self._group_backend(infos)
        futures, offset = [], 1
        for url, size in zip(self.urls, tp, strict=True):
            body = request_body(
                InitWeightsUpdateGroupRequest(
                    master_address=addr,
                    master_port=port,
                    rank_offset=offset,
                    world_size=world,
                    group_name=self.group_name,
                    backend=self.backend,
                )
            )
            futures.append(self._pool.submit(self._post, url, "/init_weights_update_group", body))
            offset += size
        try:  # until every server has joined: the HTTP requests above are in flight
            joined = _in_thread(
                init_weight_update_group,
                backend=self.backend,
                master_address=addr,
                master_port=port,
                rank=0,
                world_size=world,
                group_name=self.group_name,
                timeout_s=self.cfg.group_timeout_s,
            )
            # a server that refused leaves that thread waiting for it (until group_timeout_s, on a
            # port nobody uses again)
            self.group = self._while_servers_answer(joined, futures)
            self._wait(futures)
        finally:
            dist.barrier()
        log.info("weight_group_ready", group=self.group_name, world_size=world, servers=len(self.urls))

    def _group_backend(self, infos: list[dict[str, Any]]) -> Literal["gloo", "nccl"]:
        """NCCL unless ``cfg.backend`` names one, the model is on CPU, or a server says (its
        ``gpu_uuid``, which our reference server reports) it runs on this rank's GPU: NCCL refuses
        two ranks on one GPU ("Duplicate GPU detected"), so such a group uses gloo, which moves
        CUDA tensors through host memory. Real SGLang does not say; colocated with one, set
        ``trainer.push.backend = "gloo"``."""
        if self.cfg.backend != "auto" or self.device.type != "cuda":
            return self.backend
        ours = gpu_uuid(self.device)
        shared = [u for u, info in zip(self.urls, infos, strict=True) if info.get("gpu_uuid") == ours]
        if not shared:
            return "nccl"
        log.info(
            "weight_group_colocated",
            servers=shared,
            backend="gloo",
            reason="NCCL: one rank per GPU",
            hint="trainer.push.method = 'tensor' hands the buckets over by CUDA IPC instead, without the "
            "copies through host memory that gloo makes",
        )
        return "gloo"

    def disconnect(self) -> None:
        """Ask the servers to leave the group and drop it (rank 0)."""
        if self.rank == 0 and self.group is not None:
            body = request_body(DestroyWeightsUpdateGroupRequest(group_name=self.group_name))
            for f in self._post_all("/destroy_weights_update_group", body):
                try:
                    f.result(timeout=30)
                except Exception as e:  # a dead server cannot leave; nothing else to do
                    log.warning("destroy_group_failed", error=str(e))
            destroy_weight_update_group(self.group)
            self.group = None

    def close(self) -> None:
        """Release the group, the HTTP client and the thread pool."""
        self.disconnect()
        self._pool.shutdown(wait=False)
        if self._http is not None:
            self._http.close()

    # ---- push --------------------------------------------------------------------------------
    def push(self, version: int, keep_paused: bool = False) -> dict[str, float]:
        """Pause, send the current weights, set ``weight_version``, continue; collective.

        The first bucket is gathered while the servers pause (under ``retract`` a pause waits for
        the running decode step): gathering needs nothing from them. With ``keep_paused`` a push
        that succeeds leaves the servers paused (``left_paused`` in the result counts them): the
        caller continues them once its clients have re-posted, so each server has work the moment
        it continues. A push that fails continues them whatever ``keep_paused`` says.
        """
        t0, wall0 = time.perf_counter(), time.time()
        adapter = self.lora is not None
        bucketed = self.cfg.method in ("distributed", "tensor") and not adapter  # else disk or adapter
        pause = self.cfg.pause_mode if self.rank == 0 else None  # rank 0 pauses, in this mode
        session = self.rank == 0 and bucketed and self.cfg.weight_update_session
        self._timing = {"gather_s": 0.0, "wait_s": 0.0}
        undo: dict[str, list[str]] = {url: [] for url in self.urls}  # per server, in order
        if adapter and self.rank == 0:  # while the servers still run (see the module docstring)
            self._unload_old_adapters()
        prepare = [
            self._pool.submit(self._prepare, url, pause, session, undo[url])
            for url in self.urls
            if pause or session
        ]
        error: BaseException | None = None
        left_paused = 0
        try:
            if bucketed and self.gatherer is None:  # collective; its buffers are reused
                self.gatherer = ParamGatherer(
                    self.model, self.cfg.bucket_bytes, self.send_dtype, shared_memory=self.cfg.shared_memory
                )
            first = self._timed_gather(0) if bucketed and self._gathered.buckets else []
            folder, nbytes = None, 0
            if adapter:  # gathered and written while the servers pause
                try:
                    folder, nbytes = self._write_adapter(version)
                except Exception as e:  # any failure is every rank's to agree on (_agree) before raising
                    error = e
            try:
                self._wait(prepare)
            except Exception as e:  # any failure is every rank's to agree on (_agree) before raising
                error = error or e
            t_paused = time.perf_counter()
            self._agree(error)
            if adapter:
                self._load_adapter(version, folder)
            else:
                nbytes = self._push_buckets(str(version), first) if bucketed else self._push_disk(version)
            if keep_paused:  # pushed: leave the continue to the caller
                for steps in undo.values():
                    if "/continue_generation" in steps:
                        steps.remove("/continue_generation")
                        left_paused += 1
        finally:
            t_sent = time.perf_counter()
            # a server must not be told to continue before it was told to pause
            late = wait(prepare, timeout=self.cfg.http_timeout_s).not_done
            if late:
                log.warning("weight_push_prepare_unfinished", servers=len(late))
            self._undo(undo)  # best effort: never leave a server paused or in our session
        elapsed = time.perf_counter() - t0
        paused, sent = wall0 + (t_paused - t0), wall0 + (t_sent - t0)
        TRACE.span("pause servers", wall0, paused)
        TRACE.span("send weights", paused, sent, bytes=nbytes)
        TRACE.span("resume servers", sent, wall0 + elapsed)
        TRACE.span("weight push", wall0, wall0 + elapsed, version=version)
        if self.rank == 0:
            log.info(
                "weights_pushed",
                version=version,
                method="adapter" if adapter else self.cfg.method,
                seconds=round(elapsed, 3),
                mib=round(nbytes / 2**20, 1),
            )
        # pause_s: until the servers are paused and in a session (bucket 0 is gathered meanwhile);
        # transfer_s: the weights; gather_s: assembling buckets on rank 0 (bucket 0 included);
        # wait_s: waiting for broadcasts and server replies; resume_s: closing session, resuming
        return {
            "push_time_s": elapsed,
            "push_bytes": float(nbytes),
            "pause_s": t_paused - t0,
            "transfer_s": t_sent - t_paused,
            "resume_s": t0 + elapsed - t_sent,
            "left_paused": float(left_paused),
            **self._timing,
        }

    def _prepare(self, url: str, pause: str | None, session: bool, undo: list[str]) -> None:
        """One server: pause generation (in mode ``pause``, if any), then open the weight-update
        session; ``undo`` gets the steps that put it back, in order."""
        if pause:  # continue even after a failed or unanswered pause: harmless if it did not pause
            undo.append("/continue_generation")
            self._post(url, "/pause_generation", request_body(PauseGenerationRequest(mode=pause)))
        if session:
            opened = True
            try:
                self._post(
                    url, "/begin_weight_update", request_body(BeginWeightUpdateRequest(selector="all"))
                )
            except WeightPushError:  # refused: whatever session is open there is not ours to end
                opened = False
                raise
            finally:  # opened, or no answer (it may have opened one)
                if opened:
                    undo.insert(0, "/end_weight_update")

    def _undo(self, undo: dict[str, list[str]]) -> None:
        futures = [self._pool.submit(self._undo_one, url, steps) for url, steps in undo.items() if steps]
        wait(futures, timeout=2 * self.cfg.http_timeout_s)

    def _undo_one(self, url: str, steps: list[str]) -> None:
        for path in steps:
            try:
                self._post(url, path, request_body(_UNDO[path]()))
            except Exception as e:  # best-effort undo: a server that fails it is logged
                log.warning("weight_push_cleanup_failed", server=url, step=path, error=str(e))

    def _agree(self, error: BaseException | None) -> None:
        """Every rank learns whether rank 0's side failed, so all raise together (none hangs in a
        collective the failed rank skipped)."""
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if int(flag.item()):
            raise WeightPushError("weight push failed on rank 0 (see its log)")

    def _push_buckets(self, version: str, first: list[tuple[str, torch.Tensor]]) -> int:
        """Send every bucket (``first`` is bucket 0, already gathered)."""
        g = self._gathered
        error: BaseException | None = None
        if self.rank == 0 and self.cfg.method == "distributed" and self.group is None:
            error = WeightPushError("no weight-update group: call connect(urls) first")
        total = 0
        inflight: tuple[list, list[Future]] | None = None
        nxt = first
        for k in range(len(g.buckets)):
            named = nxt
            if self.rank == 0 and error is None:
                try:
                    if inflight is not None:  # at most one bucket on the wire
                        prev, inflight = inflight, None
                        self._finish(prev)
                    inflight = self._send(k, named, version)
                    total += sum(t.numel() * t.element_size() for _, t in named)
                except Exception as e:  # keep gathering with the other ranks, then fail together
                    error = e
            # gather the next bucket (into the other buffer) while this one is broadcast
            nxt = self._timed_gather(k + 1) if k + 1 < len(g.buckets) else []
        if inflight is not None and error is None:
            try:
                self._finish(inflight)
            except Exception as e:  # any failure is every rank's to agree on (_agree) before raising
                error = e
        self._agree(error)
        return total

    def _timed_gather(self, k: int) -> list[tuple[str, torch.Tensor]]:
        t0 = time.perf_counter()
        try:
            with TRACE.phase("gather", bucket=k):
                return self._gathered.gather(k)
        finally:
            self._timing["gather_s"] += time.perf_counter() - t0

    def _send(self, k: int, named: list[tuple[str, torch.Tensor]], version: str) -> tuple[list, list[Future]]:
        """Announce bucket ``k`` to every server and start its broadcast (or hand it over by
        reference); returns what to wait on. Bucket ``k``'s buffer is not written again before
        :meth:`_finish` has seen every server answer: the next gather fills the other buffer."""
        if self.cfg.method == "tensor":
            return [], self._send_by_reference(k, named, version)
        request = UpdateWeightsFromDistributedRequest(
            names=[n for n, _ in named],
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
            shapes=[list(t.shape) for _, t in named],
            group_name=self.group_name,
            flush_cache=flush_cache(self.cfg),
            weight_version=version,
        )
        if self.cfg.flattened_bucket:  # buckets hold one dtype
            request.load_format = "flattened_bucket"
            send = [self._gathered.flat(k).view(torch.uint8)]  # SGLang receives the bytes as uint8
        else:
            send = [t for _, t in named]
        posts = self._post_all("/update_weights_from_distributed", request_body(request))
        return [broadcast(t, self.group) for t in send], posts

    def _send_by_reference(self, k: int, named: list[tuple[str, torch.Tensor]], version: str) -> list[Future]:
        if self.device.type == "cpu":  # the gather buffer may be a mapped file: copy to torch's shm
            flat = self._gathered.flat(k).view(torch.uint8)
            staging = self._staging[k % 2]
            if staging is None or staging.numel() < flat.numel():
                staging = self._staging[k % 2] = torch.empty(flat.numel(), dtype=torch.uint8)
            staging[: flat.numel()].copy_(flat)
            named = self._gathered.views(k, staging)

        posts = []
        for url in self.urls:  # each rank's payload serialized on its own (IPC counts each)
            body = UpdateWeightsFromTensorRequest(
                serialized_named_tensors=[
                    serialize_named_tensors(named) for _ in range(self._tp.get(url, 1))
                ],
                flush_cache=flush_cache(self.cfg),
                weight_version=version,
            )
            posts.append(
                self._pool.submit(self._post, url, "/update_weights_from_tensor", request_body(body))
            )
        return posts

    def _finish(self, inflight: tuple[list, list[Future]]) -> None:
        t0 = time.perf_counter()
        works, posts = inflight
        with TRACE.phase("broadcast"):
            if works:  # a server that does not receive holds up the last broadcast too: watch that one
                self._while_servers_answer(_finished(works[-1]), posts)
                for w in works:
                    w.wait()  # done, or about to be: raises what failed it
            self._wait(posts)
        self._timing["wait_s"] += time.perf_counter() - t0

    # ---- adapter pushes (lora.push == "adapter") ---------------------------------------------
    def _write_adapter(self, version: int) -> tuple[Path | None, int]:
        """Gather the adapter (collective) and, on rank 0, write it as a PEFT folder; rank 0's
        error is raised on rank 0 only (``push`` agrees on it with the others)."""
        with TRACE.phase("gather adapter"):
            tensors = adapter_state(self.model)
        if self.rank != 0:
            return None, 0
        if not self.cfg.disk_dir:
            raise ValueError("adapter pushes write a folder: PushConfig.disk_dir must be set")
        root = Path(self.cfg.disk_dir)
        folder = root / f"adapter-v{version}"
        nbytes = write_adapter(folder, self.model, tensors, self.model_config_dir)
        assert self.lora is not None
        for old in root.glob("adapter-v*"):  # those no server keeps loaded after this push
            v = old.name.removeprefix("adapter-v")
            if v.isdigit() and int(v) <= version - self.lora.keep:
                shutil.rmtree(old, ignore_errors=True)
        return folder, nbytes

    def _load_adapter(self, version: int, folder: Path | None) -> None:
        """Every server loads the folder as this version's adapter and reports the version;
        collective (every rank learns whether rank 0's servers did)."""
        error: BaseException | None = None
        if self.rank == 0:
            assert self.lora is not None and folder is not None
            name = lora_name(self.lora.name, version)
            try:
                if name is None:  # version 0 is the base model: there is no adapter to load
                    raise WeightPushError("an adapter push needs a version >= 1; version 0 is the base model")
                if name in self._adapters:  # pushed again at the same version (a retried push)
                    self._unload(name)
                    self._adapters.remove(name)
                load = request_body(LoadLoRAAdapterRequest(lora_name=name, lora_path=str(folder)))
                self._wait(self._post_all("/load_lora_adapter", load))
                self._adapters.append(name)
                relabel = UpdateWeightVersionRequest(new_version=str(version), abort_all_requests=False)
                self._wait(self._post_all("/update_weight_version", request_body(relabel)))
            except Exception as e:  # any failure is every rank's to agree on (_agree) before raising
                error = e
        self._agree(error)

    def _unload(self, name: str) -> None:
        """Unload ``name`` from every server, best effort (a server that never had it, a joiner,
        says so)."""
        body = request_body(UnloadLoRAAdapterRequest(lora_name=name))
        for f in self._post_all("/unload_lora_adapter", body):
            try:
                f.result(timeout=self.cfg.http_timeout_s)
            except Exception as e:  # best effort: an adapter the server no longer holds
                log.info("lora_unload_skipped", adapter=name, error=str(e)[:200])

    def _unload_old_adapters(self) -> None:
        """Make room for this push's adapter: unload versions past the newest ``keep - 1``."""
        assert self.lora is not None
        while len(self._adapters) >= self.lora.keep:
            self._unload(self._adapters.pop(0))

    def _push_disk(self, version: int) -> int:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if not self.cfg.disk_dir:
            raise ValueError("push method 'disk' needs PushConfig.disk_dir")
        sd = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        error: BaseException | None = None
        nbytes = 0
        if self.rank == 0:
            try:
                tensors = cast(dict[str, torch.Tensor], sd)  # a full state dict: every value a tensor
                nbytes = self._save_and_load(merge_state_dict(self.model, tensors), version)
            except Exception as e:  # any failure is every rank's to agree on (_agree) before raising
                error = e
        self._agree(error)
        return nbytes

    def _save_and_load(self, sd: dict[str, torch.Tensor], version: int) -> int:
        root = Path(self.cfg.disk_dir)
        tied = bool(getattr(getattr(self.model, "config", None), "tie_word_embeddings", False))
        tensors = {
            k: (v.to(self.send_dtype) if self.send_dtype else v).contiguous()
            for k, v in sd.items()
            if not (tied and k == "lm_head.weight")
        }
        folder = write_version(root, version, tensors, self.model_config_dir)
        body = request_body(
            UpdateWeightsFromDiskRequest(
                model_path=str(folder),
                weight_version=str(version),
                flush_cache=flush_cache(self.cfg),
                abort_all_requests=False,
            )
        )
        self._wait(self._post_all("/update_weights_from_disk", body))
        prune_versions(root, version, self.cfg.keep_disk_versions)
        return sum(t.numel() * t.element_size() for t in tensors.values())
