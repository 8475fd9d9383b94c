"""Hub checks with the real ``huggingface_hub`` client: the token can write where the job pushes, the repos the
job reads exist and are accessible.

``huggingface_hub`` is imported only when one of these checks runs (``HubProbe.api``). Every call is bounded by
``call_bounded`` (the client's shared HTTP session has no timeout). Token permissions are read from
``whoami-v2`` (hub-protocol.md "Token permissions"): ``auth.accessToken.role`` is ``read``, ``write`` or
``fineGrained``; a fine-grained token can write to a namespace or repo when ``repo.write`` is in its ``global``
permissions (and the user may write there) or in a ``scoped`` entry for that user, org or repo.
"""

from __future__ import annotations

import difflib
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from guard.preflight._common import NoAnswer, call_bounded, fmt_bytes, hf_offline, hf_token, one_line
from guard.preflight._job import HubTarget
from guard.preflight._models import CheckResult

__all__ = ["HubProbe", "RepoRef", "check_hub_auth", "check_hub_repos", "token_can_write"]

log = logging.getLogger("guard.preflight.hub")

_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|gguf)$")
_WRITE_ROLES_IN_ORG = frozenset({"admin", "write", "contributor"})


@dataclass(frozen=True)
class RepoRef:
    """A repo the job reads.

    Attributes:
        repo_type: ``model`` or ``dataset``.
        repo_id: ``namespace/name``.
        origin: where it was named (``--require-model``, ``script``).
    """

    repo_type: str
    repo_id: str
    origin: str


class HubProbe:
    """The Hub client, the token and the per-call time limit, shared by the Hub checks.

    Args:
        environ: the job's environment (token, ``HF_ENDPOINT``).
        hf_api: an ``HfApi``; None creates ``HfApi(endpoint=HF_ENDPOINT)`` on first use.
        timeout_s: the limit of each call, in seconds.
    """

    def __init__(self, environ: Mapping[str, str], hf_api: Any = None, timeout_s: float = 3.0) -> None:
        self.environ = environ
        self.timeout_s = timeout_s
        self.token, self.token_source = hf_token(environ)
        self._api = hf_api
        self._lock = threading.Lock()
        self._whoami: dict[str, Any] | None = None

    def api(self) -> Any:
        """The ``HfApi`` (imports ``huggingface_hub`` the first time)."""
        with self._lock:
            if self._api is None:
                from huggingface_hub import HfApi  # slow import, only when a Hub check runs

                self._api = HfApi(endpoint=self.environ.get("HF_ENDPOINT") or None)
            return self._api

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``api.<method>(*args, token=..., **kwargs)`` bounded by ``timeout_s``; raises ``NoAnswer`` past it."""
        fn = getattr(self.api(), method)
        return call_bounded(fn, self.timeout_s, *args, token=self.token or False, **kwargs)

    def whoami(self) -> dict[str, Any]:
        """``whoami-v2`` for the token (cached)."""
        if self._whoami is None:
            self._whoami = self.call("whoami")
        return self._whoami

    def space_private(self, space_id: str) -> bool | None:
        """Whether an existing Space is private; None when it does not exist or the Hub gives no answer."""
        try:
            info = self.call("space_info", space_id)
        except Exception:  # noqa: BLE001 - any failure means "unknown"
            return None
        private = getattr(info, "private", None)
        return private if isinstance(private, bool) else None


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def token_can_write(info: Mapping[str, Any], target: HubTarget) -> tuple[str, str]:
    """Decide from a ``whoami-v2`` answer whether the token can write to ``target``.

    Returns:
        ``(verdict, text)``: verdict ``ok``, ``read_only``, ``no_namespace`` or ``fine_grained_scope``; the text
        says why (who, which role, which namespace).
    """
    user = str(info.get("name") or "?")
    orgs = {str(o.get("name")): str(o.get("roleInOrg") or "") for o in info.get("orgs") or [] if o.get("name")}
    access = (info.get("auth") or {}).get("accessToken") or {}
    role = access.get("role")
    namespace = target.namespace or user
    where = target.repo_id or f"{namespace}/<name>"
    member_role = "owner" if namespace == user else orgs.get(namespace)
    if role == "read":
        return "read_only", f"read-only token of {user}: cannot write to {where}"
    if member_role is None:
        member_of = ", ".join(sorted(orgs)) or "no org"
        return "no_namespace", (f"no access to namespace {namespace}: the token's user {user} is not a member "
                                f"(member of: {member_of})")
    if member_role != "owner" and member_role.lower() not in _WRITE_ROLES_IN_ORG:
        return "no_namespace", f"no write access to namespace {namespace}: {user} has role {member_role!r} there"
    if role == "fineGrained":
        fine = access.get("fineGrained") or {}
        if "repo.write" in (fine.get("global") or []):
            return "ok", f"fine-grained token of {user} with global repo.write; writes to {where}"
        for scoped in fine.get("scoped") or []:
            entity = scoped.get("entity") or {}
            perms = scoped.get("permissions") or []
            kind, name = entity.get("type"), entity.get("name")
            if "repo.write" not in perms:
                continue
            if (kind in ("user", "org") and name == namespace) or (kind == target.repo_type and name == target.repo_id):
                return "ok", f"fine-grained token of {user} with repo.write on {kind} {name}"
        scopes = ", ".join(
            f"{(s.get('entity') or {}).get('type')} {(s.get('entity') or {}).get('name')}"
            for s in fine.get("scoped") or [] if "repo.write" in (s.get("permissions") or [])
        ) or "nothing"
        return "fine_grained_scope", (f"fine-grained token of {user} has no repo.write for {where} "
                                      f"(it may write to: {scopes})")
    return "ok", f"token of {user} (role {role or 'unknown'}) can write to {where}"


_UNRESOLVED = ("Name or service not known", "nodename nor servname", "Temporary failure in name resolution",
               "No address associated with hostname", "getaddrinfo failed")


def _unreachable(exc: BaseException) -> str | None:
    """``"cannot be resolved"`` (DNS) or ``"cannot be connected to"`` (refused, unroutable, a connect timeout) when
    ``exc``'s chain says so, else None (an answer, or a dropped connection, is not that)."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            break
        text, kind = str(seen), type(seen).__name__
        if kind == "gaierror" or any(marker in text for marker in _UNRESOLVED):
            return "cannot be resolved"
        if kind in ("ConnectError", "ConnectTimeout", "ConnectionRefusedError") or "Connection refused" in text:
            return "cannot be connected to"
        seen = seen.__cause__ or seen.__context__
    return None


def _endpoint(environ: Mapping[str, str]) -> str:
    return environ.get("HF_ENDPOINT") or "https://huggingface.co"


def check_hub_auth(target: HubTarget | None, *, environ: Mapping[str, str], probe: HubProbe) -> list[CheckResult]:
    """The token is valid and can write where the job pushes.

    Distinct failures: Hub destination while offline, token missing, token invalid (401), read-only token, no
    (write) access to the namespace, fine-grained token without ``repo.write`` there, a Hub that cannot be resolved
    (DNS) or connected to (``--skip-check hub-auth=REASON`` runs anyway). No answer in time, or a dropped
    connection, is a warning.
    """
    name = "hub-auth"
    if target is None:
        return [CheckResult(name, "n/a", "nothing is written to the Hub (no --push-to hf://..., no push_to_hub)")]
    if offline := hf_offline(environ):
        return [CheckResult(name, "fail", f"{offline} but the job pushes to the Hub ({target.origin})",
                            "unset HF_HUB_OFFLINE, or --push-to a folder and push_to_hub=False")]
    if not probe.token:
        return [CheckResult(name, "fail", f"token missing: HF_TOKEN is not set and there is no saved token "
                            f"({target.origin})",
                            "pass a write token as a secret (hf jobs run -s HF_TOKEN ...; export HF_TOKEN=hf_...)")]
    try:
        info = probe.whoami()
    except NoAnswer:
        return [CheckResult(name, "warn", f"no answer from the Hub in {probe.timeout_s:g} s (whoami)",
                            "check HF_ENDPOINT and the network; the push at the end may fail")]
    except Exception as exc:  # noqa: BLE001 - mapped to rows below
        if _status(exc) == 401:
            return [CheckResult(name, "fail", f"token invalid: the Hub answered 401 to whoami (token from "
                                f"{probe.token_source})",
                                "create a new token with write access at https://huggingface.co/settings/tokens")]
        if (unreachable := _unreachable(exc)) is not None:
            return [CheckResult(name, "fail", f"the Hub at {_endpoint(environ)} {unreachable}, and the job pushes to "
                                f"it ({target.origin}): {one_line(exc, 160)}",
                                "check HF_ENDPOINT, DNS and the network (a proxy, a firewall); or --skip-check "
                                "hub-auth=REASON to run anyway (the push will retry at the end)")]
        return [CheckResult(name, "warn", f"could not ask the Hub who the token is: {one_line(exc, 200)}",
                            "check HF_ENDPOINT and the network; the push at the end may fail")]
    verdict, text = token_can_write(info, target)
    hints = {
        "read_only": "create a token with role write at https://huggingface.co/settings/tokens",
        "fine_grained_scope": f"give the token repo.write on {target.namespace or 'your user'} (or on the repo)",
        "no_namespace": f"push to a namespace you can write to, or ask an admin of {target.namespace} for write access",
    }
    if verdict == "ok":
        return [CheckResult(name, "pass", text)]
    return [CheckResult(name, "fail", text, hints[verdict])]


def check_hub_repos(
    refs: Sequence[RepoRef], *, environ: Mapping[str, str], probe: HubProbe
) -> tuple[list[CheckResult], int | None]:
    """Each repo the job reads exists and is accessible; a missing one gets "did you mean" candidates.

    Returns:
        ``(rows, model_size_bytes)``: one row per repo, and the weight files' size of the first model, when known.
    """
    name = "hub-repos"
    if not refs:
        return [CheckResult(name, "n/a", "no Hub repo named (no --require-model/--require-dataset, no literal "
                            "ids in the script)")], None
    if offline := hf_offline(environ):
        return [CheckResult(name, "n/a", f"{offline}: {len(refs)} repo(s) not checked online "
                            f"({', '.join(r.repo_id for r in refs)})")], None
    first_model = next((r for r in refs if r.repo_type == "model"), None)
    with ThreadPoolExecutor(max_workers=min(8, len(refs)), thread_name_prefix="guard-hub-repos") as pool:
        rows = list(pool.map(lambda ref: _check_repo(ref, probe, want_size=ref is first_model), refs))
    size = next((s for _, s in rows if s), None)
    return [row for row, _ in rows], size


def _check_repo(ref: RepoRef, probe: HubProbe, *, want_size: bool) -> tuple[CheckResult, int | None]:
    name = "hub-repos"
    label = f"{ref.repo_type} {ref.repo_id}"
    no_token = "" if probe.token else " (no HF token was sent: a private repo looks missing without one)"
    # A repo the command line requires (--require-model/--require-dataset) must be seen to exist: when the Hub
    # cannot answer, the check fails (a mistyped id would otherwise reach the paid job); an id read from the script
    # may be dead code, so there it is a warning.
    required = ref.origin.startswith("--require-")
    unsure: Literal["fail", "warn"] = "fail" if required else "warn"
    unsure_hint = ("check HF_ENDPOINT and the network" + (
        f"; {ref.origin} needs an answer: --skip-check hub-repos=REASON runs the job anyway" if required else ""))
    try:
        probe.call("auth_check", ref.repo_id, repo_type=ref.repo_type)
    except NoAnswer:
        return CheckResult(name, unsure, f"{label}: no answer from the Hub in {probe.timeout_s:g} s ({ref.origin})",
                           unsure_hint), None
    except Exception as exc:  # noqa: BLE001 - mapped below
        kind = type(exc).__name__
        if kind == "GatedRepoError":
            if not probe.token:
                return CheckResult(name, "fail", f"{label} is gated and no HF token was sent ({ref.origin})",
                                   "pass HF_TOKEN of a user who was granted access to it"), None
            return CheckResult(name, "fail", f"{label} is gated and the token's user has no access ({ref.origin})",
                               "request access on the repo's page and wait for approval, or use a token of a user "
                               "who has it"), None
        if kind in ("RepositoryNotFoundError", "RevisionNotFoundError") or _status(exc) == 404:
            guesses = _did_you_mean(ref, probe)
            guess = f"; did you mean: {', '.join(guesses)}?" if guesses else ""
            return CheckResult(name, "fail", f"{label} not found ({ref.origin}){no_token}{guess}",
                               "fix the id (check the spelling and the namespace)" + (
                                   "" if probe.token else ", or pass HF_TOKEN if it is private")), None
        if _status(exc) == 401:
            return CheckResult(name, "fail", f"{label}: the Hub refused the token (401)",
                               "create a new token at https://huggingface.co/settings/tokens"), None
        if (unreachable := _unreachable(exc)) is not None:
            return CheckResult(name, unsure, f"{label}: the Hub at {_endpoint(probe.environ)} {unreachable} "
                               f"({ref.origin})", unsure_hint), None
        return CheckResult(name, unsure, f"{label}: could not check: {one_line(exc, 200)}", unsure_hint), None
    size = _model_size(ref, probe) if want_size else None
    size_text = f", weights {fmt_bytes(size)}" if size else ""
    return CheckResult(name, "pass", f"{label} accessible ({ref.origin}){size_text}"), size


def _model_size(ref: RepoRef, probe: HubProbe) -> int | None:
    """Total size of the model's weight files (safetensors preferred), from ``model_info(files_metadata=True)``."""
    try:
        info = probe.call("model_info", ref.repo_id, files_metadata=True, timeout=probe.timeout_s)
    except Exception:  # noqa: BLE001 - size is optional
        return None
    siblings = getattr(info, "siblings", None) or []
    files = [(s.rfilename, s.size or 0) for s in siblings if _WEIGHT_FILE.search(s.rfilename)]
    safetensors = [size for path, size in files if path.endswith(".safetensors")]
    total = sum(safetensors) if safetensors else sum(size for _, size in files)
    return total or None


def _did_you_mean(ref: RepoRef, probe: HubProbe, limit: int = 3) -> list[str]:
    """Up to ``limit`` ids of the same author with a similar name (``list_models``/``list_datasets``)."""
    author, _, repo_name = ref.repo_id.partition("/")
    lister: Callable[..., Any] = getattr(probe.api(), "list_datasets" if ref.repo_type == "dataset" else "list_models")

    def fetch(**kwargs: Any) -> list[str]:
        return [item.id for item in call_bounded(lambda: list(lister(limit=100, token=probe.token or False, **kwargs)),
                                                 probe.timeout_s)]

    try:
        same_author = fetch(author=author)
    except Exception:  # suggestions are best effort (logged)
        log.debug("no suggestions for %s", ref.repo_id, exc_info=True)
        return []
    names = {rid.partition("/")[2]: rid for rid in same_author if "/" in rid}
    close = difflib.get_close_matches(repo_name, list(names), n=limit, cutoff=0.6)
    guesses = [names[n] for n in close]
    if len(guesses) < limit:
        token = max(re.split(r"[-_.]", repo_name), key=len)
        try:
            others = fetch(search=token) if len(token) >= 3 else []
        except Exception:  # noqa: BLE001
            others = []
        extra = difflib.get_close_matches(ref.repo_id, [o for o in others if o not in guesses], n=limit, cutoff=0.6)
        guesses += extra[: limit - len(guesses)]
    return guesses
