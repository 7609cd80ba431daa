"""What every BEAR process sets up before its command runs (``bear.cli.main`` calls
:func:`prepare_process`; ``bear up`` starts each child as ``python -m bear …``, so they all do).

* **The open-file limit** (``RLIMIT_NOFILE``): its soft limit is raised to the hard limit. Linux
  starts processes at a soft limit of 1,024 whatever the hard limit allows, and a server holds
  one descriptor per connection: at 1,024, 1,100 idle connections to the gateway (a slowloris)
  made its ``accept()`` fail and every real request with it, with nothing logged (issue 40). The
  hard limit is the administrator's bound and is left as it is.
* **SIGINT**: a job a non-interactive shell starts in the background (``bear up &`` in a script)
  inherits SIGINT *ignored*, and Python then installs no handler for it, so ``kill -INT`` did
  nothing (issue 40: 9 of 9 processes alive 46 s after it). An ignored SIGINT is put back to
  Python's default (``KeyboardInterrupt``), so SIGINT stops such a job as it stops one in the
  foreground — and as SIGTERM does."""

from __future__ import annotations

import signal

_FALLBACK_MAX = 1 << 20  # when the hard limit is "unlimited": Linux's default fs.nr_open


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (where the hard limit is unlimited: to
    ``/proc/sys/fs/nr_open``, the most the kernel allows). Returns (soft, hard) afterwards; a
    platform without ``resource``, or a refusal, leaves the limit as it was."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read().strip())
        except (OSError, ValueError):
            target = _FALLBACK_MAX
    if soft != resource.RLIM_INFINITY and soft < target:
        for want in (target, min(target, _FALLBACK_MAX), min(target, 10240)):  # macOS: at most OPEN_MAX
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                break
            except (ValueError, OSError):
                continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def restore_default_sigint() -> bool:
    """Put an inherited ``SIG_IGN`` of SIGINT back to Python's default handler (main thread
    only); whether it was ignored."""
    try:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            return False
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread
        return False
    return True


def prepare_process() -> None:
    """Both of the above, once, at the start of a ``bear`` process."""
    raise_open_file_limit()
    restore_default_sigint()
