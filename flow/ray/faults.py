"""What tidal makes of Ray's errors: the error a remote call raised, a dead actor in one line,
and how many times Ray restarted an actor.

Ray wraps an error raised inside a remote call in a `RayTaskError`, whose text is the remote
traceback; a call that failed because an actor died carries Ray's report of the death, a
dozen lines (the actor's class, id, pid, namespace and address, the cause, and advice).
tidal reports the error that was raised (`remote_cause`), and a death as one line naming the
actor and why it died (`death_summary`), as the local runtime reports its errors. Ray is
imported only where it is loaded already: a local run never loads it.
"""

from __future__ import annotations

import re
import sys
import warnings


class ActorLost(RuntimeError):
    """An actor of the run died and does not come back: its restarts are spent, its restart
    failed, or the call that needed it failed with its death."""


def remote_cause(error: BaseException) -> BaseException:
    """The error to report for `error`: a remote call's error is the one raised inside the
    call (through every `RayTaskError` around it), and an actor's death becomes `ActorLost`
    naming the actor (`death_summary`). The notes added to the wrappers are kept; any other
    error is returned as it is."""
    exceptions = sys.modules.get("ray.exceptions")
    if exceptions is None:
        return error
    notes: list[str] = []
    while isinstance(error, exceptions.RayTaskError) and error.cause is not None:
        notes += getattr(error, "__notes__", [])
        error = error.cause
    if isinstance(error, exceptions.RayActorError):
        notes += getattr(error, "__notes__", [])
        error = ActorLost(death_summary(error))
    for note in notes:
        if note not in getattr(error, "__notes__", []):
            add_note(error, note)
    return error


def add_note(error: BaseException, note: str) -> None:
    """`error.add_note(note)`, on Pythons before 3.11 too (notes came with 3.11: kept where
    3.11's traceback would print them)."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:
        setattr(error, "__notes__", [*getattr(error, "__notes__", []), note])  # noqa: B010


_FIELD = re.compile(r"^\s*(class_name|pid|ip): (\S+)\s*$", re.MULTILINE)
_BECAUSE = re.compile(r"The actor is dead because (.+?)\.(?:\s|$)")
_EXIT = re.compile(r"Worker exit type: (\w+)")


def death_summary(error: BaseException) -> str:
    """One line for an actor's death, from Ray's report of it: the error's type, the actor's
    class, pid and address, and why it died (`RayActorError`; a `RayTaskError` around one is
    looked through), such as "ActorDiedError: actor RolloutActor (pid 4983 at 10.0.0.2)
    died: its worker process has died (SYSTEM_ERROR)"."""
    exceptions = sys.modules.get("ray.exceptions")
    while exceptions is not None and isinstance(error, exceptions.RayTaskError) and error.cause is not None:
        error = error.cause
    text = str(getattr(error, "error_msg", None) or error)
    fields = dict(_FIELD.findall(text))
    who = "actor"
    if "class_name" in fields:
        who += f" {fields['class_name'].rsplit('.', 1)[-1]}"  # a qualified name: `make.<locals>.Actor`
    if "pid" in fields:
        who += f" (pid {fields['pid']}" + (f" at {fields['ip']}" if "ip" in fields else "") + ")"
    because = _BECAUSE.search(text)
    if because:
        exit_type = _EXIT.search(text)
        why = because.group(1) + (f" ({exit_type.group(1)})" if exit_type else "")
    else:
        why = next((line.strip() for line in text.splitlines() if line.strip()), "no reason given")
    return f"{type(error).__name__}: {who} died: {why}"


def num_restarts() -> int:
    """How many times Ray has restarted the actor this runs in (0 outside an actor, or in
    one never restarted). Ray's public API counts them only through its dashboard, which a
    tidal run does not start; the count is the GCS actor table's."""
    import ray  # noqa: PLC0415

    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return 0
    with warnings.catch_warnings():  # Ray's own property reads its deprecated `actor_id` and warns in every actor's log
        warnings.simplefilter("ignore", DeprecationWarning)
        if not context.was_current_actor_reconstructed:
            return 0
    try:
        from ray._private import state  # noqa: PLC0415

        return max(int(state.actors(context.get_actor_id())["NumRestarts"]), 1)
    except Exception:  # noqa: BLE001 - a private table that a Ray release may change: restarted, at least once
        return 1


def rank_died(error: BaseException) -> bool:
    """Whether a call on an actor (a trainer rank) failed because its process died. An error
    raised inside the call (`RayTaskError`) is not a death, even when it is itself a dead
    actor's error (a rollout actor that could not be built): Ray makes such an error an
    instance of its cause too."""
    import ray  # noqa: PLC0415

    return isinstance(error, ray.exceptions.RayActorError) and not isinstance(error, ray.exceptions.RayTaskError)
