"""The robot's side of the frames, in one place: the HELLO introducing it, a decision's prompt and
a drafted block as the frames that carry them (PREFILL, VERIFY, and HIDDEN when the verifier asks),
and a VERDICT back as the ``VerifyReply`` the decoder reads, checked. The websocket client sends
and reads them over the network; ``LocalVerifier`` hands them to the same ``VerifierSession`` in
process, so both verify exactly the same frames."""
from __future__ import annotations

import torch

from ..decoding.inputs import Prompt
from ..decoding.memory import PromptFormat
from ..decoding.verify import VerifySettings
from ..decoding.verifier import Block, VerifierError, VerifyReply, mask_of
from ..decoding.verify import NO_TOKEN, carries_q  # noqa: F401 - carries_q: the frames' rule, re-exported
from . import protocol as P


def hello_frame(fingerprint: str, vocab_size: int, codec, token: str = "", client: str = "edgespec-edge",
                draft: str = "", prompt: PromptFormat = PromptFormat()) -> P.Hello:
    """The HELLO opening a session: the robot's tokenizer (fingerprint, vocabulary), its codec (a
    ``codecs`` codec: its spec), auth token, name, draft (content hash) and how its prompts read
    (the earlier decisions they show, and whether they carry the search belief)."""
    return P.Hello(token, fingerprint, vocab_size, codec.spec, client, draft, prompt.memory, prompt.belief)


def prefill_frame(decision: int, prompt: Prompt, settings: VerifySettings) -> P.Prefill:
    """The PREFILL opening ``decision``."""
    return P.Prefill(decision, prompt.instruction, prompt.jpeg or b"", prompt.prompt_ids, settings.seed,
                     settings.params.temperature, settings.params.top_k, settings.params.top_p,
                     settings.verify_mode, settings.wisv_threshold)


def verify_frame(decision: int, block: Block, codec, exits: bool, send_q: bool = True) -> P.Verify:
    """The VERIFY carrying ``block`` (its q through ``codec`` when ``send_q``: :func:`carries_q`). Early exits are asked for when the
    block wants them and the verifier has them (``exits``), never with the split codec;
    ValueError for a conditional block with the split codec (the robot resamples a rejection)."""
    flags = P.VERIFY_STREAM_EXITS if block.stream_exits and exits and not codec.separate else 0
    if block.chained:
        flags |= P.VERIFY_CHAINED
    edge = P.NO_TOKEN if block.edge_token is None else int(block.edge_token)
    cond = block.condition
    if cond is not None and codec.separate:
        raise ValueError("conditional blocks are not valid with the split codec")
    csi, hidden = (0.0, 0.0, 0.0, 0.0), b""
    if block.hidden is not None:  # wisv
        from ..decoding.wisv import encode_hidden
        csi = tuple(block.csi.to_wire()) if block.csi is not None else csi
        flags |= P.VERIFY_WISV
        if block.upload == "full":
            flags |= P.VERIFY_HIDDEN
            hidden = encode_hidden(block.hidden)
    tree = block.tree
    if tree is not None:  # one q row per node with children, coded with its first child
        from ..decoding.tree import first_children, wire_rows
        if codec.separate or block.hidden is not None or cond is not None:
            raise ValueError("a token tree is sent in an unconditional round, not with the split codec or wisv")
        flags &= ~P.VERIFY_STREAM_EXITS
        # a greedy tree (q None) sends no q: the verifier takes the target's argmax path
        q = (codec.encode(first_children(tree), wire_rows(tree, torch.as_tensor(block.q)))
             if send_q and block.q is not None else b"")
    else:
        q = codec.encode(block.draft_ids, block.q) if send_q else b""
    return P.Verify(decision, block.round, list(block.draft_ids), q, flags,
                    edge, block.epoch, [] if cond is None else [cond.round, cond.accepted, cond.token], csi, hidden,
                    list(block.parents or ()))


def hidden_frame(request: P.HiddenRequest, block: Block | None) -> P.Hidden:
    """wisv selective upload: the HIDDEN answer to the verifier's HIDDEN_REQUEST for ``block``
    (the block of that round in flight, or None); VerifierError for a request no block can answer."""
    from ..decoding.wisv import encode_hidden
    if block is None or block.hidden is None:
        raise VerifierError(f"the verifier asked for hidden rows of round {request.round}, which has none in flight")
    positions = list(request.positions)
    if not positions or len(set(positions)) != len(positions) or max(positions) >= len(block.draft_ids):
        raise VerifierError(f"the verifier asked for hidden rows at positions {positions[:8]} of a "
                            f"{len(block.draft_ids)}-token block")
    return P.Hidden(request.decision, request.round, positions, encode_hidden(block.hidden[positions]))


def verdict_reply(verdict: P.Verdict, block: Block, codec, vocab_size: int) -> VerifyReply:
    """The reply a VERDICT gives the decoder for ``block`` (compute and queue times from the
    verdict; link times are the caller's). VerifierError for a verdict the robot cannot have
    asked for: out of range, a continuation of a block that was not chained or not accepted in
    full, a target distribution without a split-codec rejection (or the reverse)."""
    if block.parents is not None:
        return _tree_reply(verdict, block, vocab_size)
    if verdict.path:
        raise VerifierError("verdict names a tree path for a chain block: the verifier speaks another protocol")
    n = len(block.draft_ids)
    target_p = _target_p(verdict, n, codec, vocab_size) if verdict.p_payload else None
    continued = verdict.next_token == P.NO_TOKEN and target_p is None
    if verdict.accepted > n or (not continued and target_p is None and verdict.next_token >= vocab_size) \
            or (continued and (not block.chained or verdict.accepted != n)):
        raise VerifierError("verdict out of range: the verifier speaks another model or protocol")
    next_token = NO_TOKEN if verdict.next_token == P.NO_TOKEN else int(verdict.next_token)
    return VerifyReply(verdict.accepted, next_token, mask_of(verdict.accepted, n), verify_s=verdict.verify_ms / 1e3,
                       exit_layer=verdict.exit_layer, round=block.round, epoch=block.epoch, target_p=target_p,
                       queue_s=verdict.queue_ms / 1e3, relaxed=verdict.relaxed)


def _tree_reply(verdict: P.Verdict, block: Block, vocab_size: int) -> VerifyReply:
    """A tree block's VERDICT: its path must run from the root down through the block's tree, and
    a next token must follow it, unless the block was chained and the path is its main path."""
    from ..decoding.tree import main_path
    path = [int(i) for i in verdict.path]
    parents = block.parents
    continued = verdict.next_token == P.NO_TOKEN  # a chained tree's main path, accepted in full
    ok = len(path) == verdict.accepted and not verdict.p_payload and (
        verdict.next_token < vocab_size or (continued and block.chained and path == main_path(block.tree)))
    above = -1
    for node in path:
        ok = ok and 0 <= node < len(parents) and parents[node] == above
        above = node
    if not ok:
        raise VerifierError("verdict out of range for the tree sent: the verifier speaks another model or protocol")
    accepted = set(path)
    return VerifyReply(len(path), NO_TOKEN if continued else int(verdict.next_token),
                       [i in accepted for i in range(len(parents))],
                       verify_s=verdict.verify_ms / 1e3, exit_layer=verdict.exit_layer, round=block.round,
                       epoch=block.epoch, queue_s=verdict.queue_ms / 1e3, path=tuple(path))


def _target_p(verdict: P.Verdict, n: int, codec, vocab_size: int) -> torch.Tensor:
    """Split codec: the verifier rejected draft ``accepted`` and sent p there (the robot resamples)."""
    from ..codecs import CodecError
    if not codec.separate or verdict.next_token != P.NO_TOKEN:
        raise VerifierError("verdict carries a target distribution without a split-codec rejection (or the "
                            "reverse): the verifier speaks another protocol")
    if verdict.accepted >= n:
        raise VerifierError("verdict out of range: a rejection after the last draft")
    try:
        return codec.decode_p(verdict.p_payload, vocab_size)
    except CodecError as exc:
        raise VerifierError(f"bad target distribution from the verifier: {exc}") from exc
