"""Auth token files, read the same way by the verifier (``--token-file``: one token per tenant)
and the drafter (``token_file``: its one token): one token per line, blank lines and lines
starting with # skipped."""
from __future__ import annotations


def read_tokens(path: str, what: str = "token file") -> list[str]:
    """The tokens in ``path``; ValueError names ``what`` (the option that gave it), the file and the
    problem (unreadable, no token)."""
    try:
        with open(path, encoding="utf-8") as f:
            tokens = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError as exc:
        raise ValueError(f"{what} {path!r} cannot be read: {exc.strerror}") from None
    if not tokens:
        raise ValueError(f"{what} {path!r} holds no token")
    return tokens


def read_token(path: str, what: str = "token_file") -> str:
    """The one token of a client's token file ('' for no file); ValueError if it holds several."""
    if not path:
        return ""
    tokens = read_tokens(path, what)
    if len(tokens) > 1:
        raise ValueError(f"{what} {path!r} holds {len(tokens)} tokens: a client presents one")
    return tokens[0]
