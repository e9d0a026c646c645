"""edgespec-verifier's configuration: the command line, tokens, TLS, limits and the model,
turned into a ``VerifierServer`` (``build_server``). Shared by the one-process verifier
(``cloud.cli``) and its Ray Serve replicas (``cloud.ray_serve``)."""
from __future__ import annotations

import argparse
import logging
import os

from ..decoding.compute import compute_arg, compute_help, get_compute
from ..decoding.engines import QUANTIZATIONS, ModelLoadError, load_model
from ..decoding.kv_pages import BLOCK_SIZE, KV_FREE_SHARE, KVPool, default_budget
from ..wire import protocol as P
from .limits import ServerLimits
from .limits import is_loopback
from .server import VerifierServer
from .exit_stream import EXIT_QUEUE_POLICIES
from ..wire.tokens import read_tokens

log = logging.getLogger("edgespec.verifier")


def read_token_file(path: str | None) -> list[str]:
    """Auth tokens, one per line (one per tenant: a robot fleet, a lab); blank lines and lines
    starting with # are skipped. None: no auth."""
    if path is None:
        return []
    try:
        tokens = read_tokens(path, "--token-file")
    except ValueError as exc:
        raise SystemExit(f"edgespec-verifier: {exc}") from None
    short = [i + 1 for i, t in enumerate(tokens) if len(t) < 16]
    if short:
        log.warning("--token-file: token(s) %s shorter than 16 characters are easy to guess "
                    "(e.g. `python -c \"import secrets; print(secrets.token_urlsafe(32))\"`)", short)
    return tokens


def tls_context(cert: str | None, key: str | None):
    """The server's TLS context from a certificate chain and its private key (PEM)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise SystemExit("edgespec-verifier: --tls-cert and --tls-key go together")
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # No TLS 1.3 session tickets: sessions are long-lived and never resumed, and a ticket arrives
    # just after the handshake, while the robot's websocket client reads on one thread and writes
    # its upgrade request on another: concurrent reads and writes on one Python SSL socket race
    # (a spurious "[SSL] internal error" or a stalled handshake, seen under load).
    ctx.num_tickets = 0
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"edgespec-verifier: cannot load --tls-cert {cert!r} / --tls-key {key!r}: {exc}")
    return ctx


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="edgespec-verifier",
        description="Cloud verifier for edge-cloud speculative decoding: serves a target (Qwen2-VL or causal LM) "
                    "over websockets; robots connect with the edge client (modes ar, sd and, with early-exit "
                    "adapters, fsd).")
    ap.add_argument("--model", default=None,
                    help="local directory of the target model (config.json, weights, tokenizer); "
                         "default: the embedded target model shipped with the package")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    ap.add_argument("--port", type=int, default=8765, help="TCP port (default 8765; 0 picks a free port)")
    ap.add_argument("--token-file", default=None,
                    help="file of auth tokens, one per line (one per tenant; each tenant gets a fair share of "
                         "compute); clients must present one. Required unless --host is loopback")
    ap.add_argument("--insecure-no-auth", action="store_true",
                    help="serve a non-loopback --host without --token-file (anyone reaching the port may use it)")
    ap.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve wss:// (with --tls-key)")
    ap.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    ap.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                    help="prefill every decision's whole prompt (default: keep the part of a session's cache the "
                         "new prompt shares with the last one, e.g. the earlier turns of a policy with memory)")
    ap.add_argument("--split-forward", default="auto", choices=["auto", "on", "off"],
                    help="pause a native forward pass between two decoder layers when another tenant that has used "
                         "less compute waits (a tenant's long pass or prefill piece holds the others for one layer; "
                         "the results are the same bit for bit); off: every pass runs whole; auto (default): on on "
                         "a CPU where tenants are kept apart (--tenants-per-pass 1), off where their rounds share "
                         "passes (a round that waits rides the next pass instead of costing one of its own) and on a "
                         "GPU (a checkpoint there sees a layer's launch, not its end: `on` synchronises at each pause)")
    ap.add_argument("--max-frame", type=int, default=P.DEFAULT_MAX_FRAME,
                    help=f"largest accepted frame in bytes (default {P.DEFAULT_MAX_FRAME})")
    ap.add_argument("--compute", default="native", type=compute_arg,
                    help=f"the target's compute: {compute_help()} (default native)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                    help="weights dtype (default float32; auto: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N or auto")
    ap.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                    help="int8 / nf4 weights through bitsandbytes (cuda only; default none)")
    ap.add_argument("--torch-threads", default="auto", type=threads_arg,
                    help="torch's intra-op threads for the model's work: a number, or auto (default): 1 on cuda "
                         "(the GPU computes; the host only launches), else every core this process may use but one, "
                         "which the event loop keeps (on 2 cores, 2 threads made a tiny model's step 80x dearer)")
    ap.add_argument("--idle-timeout", type=float, default=300.0, help="close sessions idle this many seconds")
    ap.add_argument("--exits", default="auto",
                    help="early-exit adapters for fsd: a directory (from `edgespec-train exits`), 'auto' (those in "
                         "<model>/exits if present; default) or 'none' (the verifier then serves ar and sd only)")
    ap.add_argument("--wisv", default="auto",
                    help="WISV decision head (verify mode wisv, LOSSY): a directory (from `edgespec-train wisv`), "
                         "'auto' (<model>/wisv if present; default) or 'none'")
    ap.add_argument("--exit-queue", default="priority", choices=list(EXIT_QUEUE_POLICIES),
                    help="order in which early exits are streamed: most confident first (priority, default) or fifo")
    ap.add_argument("--exit-queue-size", type=int, default=64,
                    help="bound of the per-round exit send queue (default 64; beyond it the last-ranked exit is dropped)")
    lim = ap.add_argument_group("limits", "what one client may cost the verifier (refusals name the option)")
    d = ServerLimits()
    for name, option, kind, text in LIMIT_OPTIONS:
        if name in QUANTUM_SIZES:
            cpu, gpu = QUANTUM_SIZES[name]
            lim.add_argument(option, dest=name, type=auto_or_int, default="auto", metavar="INT",
                             help=f"{text} (default auto: {cpu} with the target on a CPU, {gpu} on a GPU)")
            continue
        lim.add_argument(option, dest=name, type=kind, default=getattr(d, name), metavar=kind.__name__.upper(),
                         help=f"{text} (default {getattr(d, name)})")
    ap.add_argument("--kv-budget-gb", type=kv_budget_arg, default="auto", metavar="GIB",
                    help="memory of the sessions' KV caches, in GiB, allocated at start in blocks of "
                         f"{BLOCK_SIZE} positions: a PREFILL is refused BUSY ('verifier full') when its prompt and "
                         "its decision's maximum (--max-new-tokens more) do not fit beside the open sessions' "
                         f"(default auto: what --max-sessions such decisions need, at most {KV_FREE_SHARE:g} of the "
                         "device's free memory after the weights are loaded)")
    ap.add_argument("--cuda-graphs", default=None, choices=["on", "off"],
                    help="verification passes and AR steps of up to 16 rows replayed as CUDA graphs captured "
                         "at start-up per bucket of rows, tokens per row and KV blocks (cloud.graphs; a pass "
                         "no bucket holds runs eagerly); default off: not yet run on a GPU (scripts/gpu_graphs.sh checks it)")
    ap.add_argument("--max-batch", type=int, default=8,
                    help="verification rounds of up to this many sessions run as one batched forward pass "
                         "(rounds streaming early exits are batched too, each exit streamed from its own row); 1 = one at a time (default 8)")
    ap.add_argument("--status-interval", type=float, default=60.0,
                    help="seconds between status log lines (sessions, refusals, compute load); 0 = none (default 60)")
    ap.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    rec = ap.add_argument_group("traces", "record every verify round for distilling the draft (docs/traces.md); "
                                          "off by default")
    rec.add_argument("--record-traces", default=None, metavar="DIR",
                     help="write the rounds to safetensors shards under DIR/<tenant>/ (off by default)")
    rec.add_argument("--record-traces-max-mb", type=float, default=256.0,
                     help="bound on each tenant's shards in MiB; the oldest shard is deleted first (default 256)")
    rec.add_argument("--record-traces-max-files", type=int, default=64,
                     help="bound on each tenant's shard count; the oldest is deleted first (default 64)")
    rec.add_argument("--record-traces-topk", type=int, default=16,
                     help="the target's top-k (ids and log-probs) kept at each drafted and bonus position (default 16)")
    rec.add_argument("--record-images", action="store_true",
                     help="also record each decision's JPEG: the robots' camera frames (off by default; privacy)")
    ray = ap.add_argument_group("scale-out", "N replicas of this verifier on Ray Serve behind one websocket endpoint "
                                             "(--host/--port); needs `pip install .[fleet]`")
    ray.add_argument("--replicas", type=int, default=None,
                     help="serve this many replicas on Ray Serve, each with its own model and batching engine "
                          "(default: one process, no Ray)")
    ray.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                     help="let Ray Serve's autoscaler keep MIN..MAX replicas by open sessions "
                          "(--sessions-per-replica each); --replicas is the starting count")
    ray.add_argument("--sessions-per-replica", type=int, default=None,
                     help="autoscaling target of open sessions per replica (default --max-batch)")
    ray.add_argument("--ray-address", default=None,
                     help="join this Ray cluster ('auto': the one `ray start --head` started here); default: "
                          "start a local Ray instance on this machine")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0,
                     help="GPUs Ray reserves per replica (default 0; with > 0 the replica loads on cuda)")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0,
                     help="CPUs Ray reserves per replica (default 1; also its torch threads)")
    return ap


# ServerLimits field, type, help: the CLI options of the limits (one table: README "Security and limits").
LIMIT_OPTIONS = [
    ("max_sessions", "--max-sessions", int, "authenticated sessions, all tenants"),
    ("max_handshakes", "--max-handshakes", int, "connections that have not yet sent an accepted HELLO (when full, "
                                                "one from a stranger's address holding the most is closed for a new one)"),
    ("max_handshakes_per_address", "--max-handshakes-per-address", int,
     "of those, from one IP address (an IPv6 client: its /64; sessions are not counted per "
     "address: a fleet behind one NAT)"),
    ("connect_rate", "--connect-rate", float, "new connections per second from one IP address (bursts of twice that)"),
    ("max_connections", "--max-connections", int, "TCP connections open at once, all addresses (at most the "
                                                  "process's file limit less 364, read at start-up and logged): "
                                                  "past it a connection is closed as it is accepted; "
                                                  "--max-sessions of them (at most a quarter) are kept for "
                                                  "addresses that authenticated in the last hour"),
    ("header_timeout_s", "--header-timeout", float, "seconds a connection has to send its whole HTTP upgrade "
                                                    "request (a slow one is closed; far below --handshake-timeout)"),
    ("auth_failures", "--auth-failures", int, "failed HELLOs with one token guess from one address that refuse "
                                               "that guess there for the rest of --auth-window (the right token "
                                               "from the same address is never refused)"),
    ("auth_window_s", "--auth-window", float, "seconds of the auth-failure window"),
    ("max_prompt_tokens", "--max-prompt-tokens", int, "prompt tokens per decision (the model's context at most)"),
    ("max_image_pixels", "--max-image-pixels", int, "decoded image pixels, read from the header before decoding "
                                                    "(Qwen2-VL max_pixels)"),
    ("max_image_bytes", "--max-image-bytes", int, "encoded image bytes"),
    ("max_new_tokens", "--max-new-tokens", int, "tokens one GENERATE may ask for"),
    ("max_rounds", "--max-rounds", int, "VERIFY frames per decision"),
    ("max_sessions_per_token", "--max-sessions-per-token", int, "concurrent sessions per auth token"),
    ("max_tenant_inbox_bytes", "--max-tenant-inbox-bytes", int,
     "bytes of frames read ahead across one tenant's sessions (each session's own is its largest frame)"),
    ("prefill_chunk", "--prefill-chunk", int, "prompt tokens per prefill piece at a prompt's start, each one quantum of "
                                              "the fair scheduler; deeper pieces hold fewer, bounded by cost (smaller: "
                                              "a robot's round waits less behind another tenant's prefill)"),
    ("max_batch_tokens", "--max-batch-tokens", int, "tokens one batched pass may feed, its rows summed, each pass "
                                                    "one quantum of the fair scheduler (smaller: a robot's round waits "
                                                    "less behind a batch of another tenant's long drafts)"),
    ("tenants_per_pass", "--tenants-per-pass", int, "auth tokens whose rounds may share one batched pass (1: a "
                                                    "tenant's robots batch only with each other, and a robot's pass "
                                                    "never carries another tenant's rows)"),
]


def kv_budget_arg(text: str):
    """--kv-budget-gb: 'auto' or a positive number of GiB."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"give a positive number of GiB or auto, not {text!r}")
    return value


def kv_pool(lm, choice, limits: ServerLimits):
    """The verifier's KV pool (``decoding.kv_pages.KVPool``) under --kv-budget-gb, made now (its
    bytes are allocated at once) and set as the model's; SystemExit when it holds no block."""
    from ..decoding.verifier import MAX_BLOCK
    if choice == "auto":
        context = lm.max_context or limits.max_prompt_tokens + limits.max_new_tokens
        positions = min(min(limits.max_prompt_tokens, context) + limits.max_new_tokens + MAX_BLOCK + 1, context)
        budget = default_budget(lm, limits.max_sessions, positions)
    else:
        budget = int(choice * (1 << 30))
    try:
        pool = KVPool.for_model(lm, budget)
    except ValueError as exc:
        raise SystemExit(f"edgespec-verifier: --kv-budget-gb: {exc}") from None
    lm.__dict__["_kv_pool"] = pool
    log.info("KV cache: %.3f GiB in %d blocks of %d positions (%d positions in all; --kv-budget-gb %s)",
             pool.bytes / (1 << 30), pool.blocks, pool.block_size, pool.blocks * pool.block_size, choice)
    return pool


def cuda_graphs(lm, choice: str | None) -> bool:
    """--cuda-graphs: the model's passes captured (``cloud.graphs.attach_graphs``: the buckets
    are listed in the log) or eager; SystemExit for ``on`` without a CUDA device."""
    from .graphs import attach_graphs, cuda_graphs_enabled
    try:
        on = cuda_graphs_enabled(choice, lm.device)
    except ValueError as exc:
        raise SystemExit(f"edgespec-verifier: {exc}") from None
    if on:
        attach_graphs(lm)
    else:
        log.info("CUDA graphs: off (--cuda-graphs %s, target on %s)", choice or "default", lm.device)
    return on


def threads_arg(text: str) -> str:
    """--torch-threads: 'auto' or a positive integer."""
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number of threads nor 'auto'")


# The fair scheduler's quantum sizes and tenant sharing, by where the target runs (docs/verifier.md:
# the soak): a robot's round waits for at most one quantum of another tenant's work. On a CPU a
# prefill piece or a pass costs in proportion to its tokens, so small quanta keep that wait short
# (64 and 64: p99 1.15x of unloaded under 100 hostile clients, against 1.73x with 256 and 512),
# and another tenant's rows in a robot's pass only lengthen it; on a GPU a pass of 64 tokens costs
# about what one of 256 does and a pass of 8 rows about one, so larger quanta and shared passes
# keep throughput. (CPU value, GPU value).
QUANTUM_SIZES = {"prefill_chunk": (64, 256), "max_batch_tokens": (64, 512), "tenants_per_pass": (1, 64)}


def auto_or_int(text: str):
    """'auto' or a positive integer (the quantum sizes' options)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"give a positive integer or auto, not {text!r}")
    return value


def limits_from_args(args) -> ServerLimits:
    """The verifier's limits from its options, the quantum sizes and tenant sharing resolved for
    ``args.device`` (ValueError for a limit out of range)."""
    values = {name: getattr(args, name) for name, *_ in LIMIT_OPTIONS}
    on_gpu = str(getattr(args, "device", "cpu")).startswith("cuda") or (
        getattr(args, "device", "cpu") == "auto" and _cuda_available())
    # an emulated profile charges a pass its profile's time (a GPU's): tenants share passes there
    emulated = getattr(args, "compute", "native") not in ("native", None)
    for name, sizes in QUANTUM_SIZES.items():
        if values[name] == "auto":
            values[name] = sizes[on_gpu or (emulated and name == "tenants_per_pass")]
    return ServerLimits(**values)


def torch_threads(choice: str, device: str) -> int:
    """The intra-op thread count --torch-threads asks for (see its help)."""
    if choice != "auto":
        return int(choice)
    if str(device).startswith("cuda") or (device == "auto" and _cuda_available()):
        return 1
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def build_server(args, tokens: list[str] | None = None, server_name: str = "edgespec-verifier",
                 metrics_labels: dict | None = None) -> VerifierServer:
    """The VerifierServer the options describe (model, exits, limits, auth, TLS); SystemExit with
    a clear message when they are wrong. ``tokens``: already read (a Ray replica gets them from
    the driver, the token file may not exist on its node)."""
    from ..models import default_model_path
    path = args.model or default_model_path("target")
    tokens = read_token_file(args.token_file) if tokens is None else tokens
    ssl_context = tls_context(args.tls_cert, args.tls_key)
    try:
        limits = limits_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"edgespec-verifier: {exc}") from None
    check_auth_options(args, tokens)
    if getattr(args, "record_images", False) and getattr(args, "record_traces", None) is None:
        raise SystemExit("edgespec-verifier: --record-images records into --record-traces DIR: give both")
    threads = torch_threads(args.torch_threads, args.device)
    import torch
    torch.set_num_threads(threads)
    log.info("torch threads: %d (--torch-threads %s)", threads, args.torch_threads)
    try:
        lm = load_model(path, dtype=args.dtype, device=args.device, quantization=args.quantization)
    except ModelLoadError as exc:
        raise SystemExit(f"edgespec-verifier: {exc}") from None
    from ..decoding.exits import ExitLoadError, attach_exits
    from ..decoding.wisv import attach_wisv
    try:
        exits = attach_exits(lm, args.exits)
        head = attach_wisv(lm, args.wisv)
    except (ExitLoadError, ValueError) as exc:
        raise SystemExit(f"edgespec-verifier: {exc}") from None
    log.info("wisv: %s", f"decision head for {head.config.draft_dim}-wide drafter states (verify mode wisv "
                         "available, LOSSY)" if head else "no decision head (verify mode wisv unavailable)")
    log.info("early exits: %s", f"layers {exits.layers} of {lm.num_layers} (fsd available)" if exits
             else "none (fsd unavailable: modes ar and sd)")
    log.info("precision: %s", precision_note(next(lm.model.parameters()).dtype))
    kv_pool(lm, getattr(args, "kv_budget_gb", "auto"), limits)
    cuda_graphs(lm, getattr(args, "cuda_graphs", None))
    server = VerifierServer(lm, token=tokens, max_frame=args.max_frame, compute=get_compute(args.compute),
                            idle_timeout_s=args.idle_timeout, exit_queue=args.exit_queue,
                            exit_queue_size=args.exit_queue_size, limits=limits, ssl_context=ssl_context,
                            insecure_no_auth=args.insecure_no_auth, status_interval_s=args.status_interval,
                            max_batch=args.max_batch, server_name=server_name, metrics_labels=metrics_labels,
                            split_forward={"on": True, "off": False}.get(getattr(args, "split_forward", "auto")))
    server.prefix_reuse = getattr(args, "prefix_reuse", True)
    server.recorder = trace_recorder(args, server.model_name, server.fingerprint)
    freeze_startup_heap()
    hand_over_the_interpreter_often()
    return server


def freeze_startup_heap() -> int:
    """Move every object alive after start-up (the model, the tokenizer, the imported modules:
    ~400k objects with transformers) out of the garbage collector's reach (``gc.freeze``): a
    full collection no longer walks them, so one costs what the sessions' own objects cost, not
    100-400 ms with the GIL held. Those pauses stalled the event loop and the compute thread
    together, and the allocation churn of many clients' frames makes them come more often: the
    tail of every robot's decision time under load. Returns the objects frozen."""
    import gc
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects out of the garbage collector's full passes", frozen)
    return frozen


# How often a thread holding the interpreter lock hands it over (Python's default is 5 ms).
SWITCH_INTERVAL_S = 0.001


def hand_over_the_interpreter_often() -> float:
    """The verifier's threads share one interpreter: the event loop (every connection's frames, a
    robot's among them), the compute thread (Python between the model's ops) and, when recording,
    the trace writer. At Python's
    default 5 ms a frame that arrives while the compute thread holds the lock waits up to 5 ms to
    be read, and a forward waits as long behind a burst of other clients' handshakes; handing it
    over every 1 ms bounds both (measured in the soak: docs/verifier.md). Returns the interval."""
    import sys
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    return sys.getswitchinterval()


def precision_note(dtype) -> str:
    """What the lossless claim holds to in this precision (measured: docs/gpu-profile.md)."""
    import torch
    if dtype == torch.float32:
        return ("float32: greedy output token-identical to the target decoding alone, rounds batched or not "
                "(measured on an H200 and on CPU)")
    return (f"{str(dtype).replace('torch.', '')}: verification is lossless in distribution, but greedy output is "
            "NOT token-identical to the target decoding alone, batched or not: a block's logits round differently "
            "from one token's and near-ties flip (measured on an H200: 9 of 12 decisions differ somewhere even "
            "unbatched). --dtype float32 for token identity (2x the weights' memory)")


def trace_recorder(args, model_name: str, fingerprint: str):
    """The TraceRecorder the --record-* options ask for (None: recording off); SystemExit when they are wrong."""
    if getattr(args, "record_traces", None) is None:
        return None
    from .traces import TraceRecorder
    try:
        recorder = TraceRecorder(args.record_traces, max_bytes=int(args.record_traces_max_mb * (1 << 20)),
                                 max_files=args.record_traces_max_files, topk=args.record_traces_topk,
                                 record_images=args.record_images, target=model_name, target_fingerprint=fingerprint)
    except ValueError as exc:
        raise SystemExit(f"edgespec-verifier: --record-traces: {exc}") from None
    log.info("recording verify rounds to %s (top-%d, %g MiB and %d shards per tenant%s)", args.record_traces,
             recorder.topk, args.record_traces_max_mb, recorder.max_files,
             "; WITH the robots' camera images (--record-images)" if recorder.record_images else "; no images")
    return recorder


def check_auth_options(args, tokens: list[str]) -> None:
    """Refuse a network address without auth (unless waived) before any weights are loaded."""
    if not tokens and not is_loopback(args.host) and not args.insecure_no_auth:
        raise SystemExit(f"edgespec-verifier: refusing to serve on {args.host} without auth: give --token-file (and "
                         "--tls-cert/--tls-key), or --insecure-no-auth to let anyone who reaches the port use the "
                         "model")
