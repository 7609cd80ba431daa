"""What every ``bear`` process sets up at start (bear.runtime.process, called by bear.cli.main;
issue 40): the open-file soft limit raised to the hard limit (at 1,024, 1,100 idle connections
starved the gateway), and an inherited ignored SIGINT — a script's ``bear up &`` — put back to the
default, so SIGINT stops such a process. The whole ``bear up`` under SIGINT:
tests/stack/test_up_signals.py."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys

from waiting import HANG_S

SOFT = 256


def _low_soft_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))


def test_the_cli_entry_raises_the_open_file_limit_to_the_hard_limit() -> None:
    code = ("import atexit, resource, bear.cli\n"
            "atexit.register(lambda: print('limits', *resource.getrlimit(resource.RLIMIT_NOFILE), flush=True))\n"
            "bear.cli.main(['--help'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S,
                         preexec_fn=_low_soft_limit, check=True).stdout
    soft, hard = (int(x) for x in out.split("limits", 1)[1].split())
    assert hard > SOFT, "the hard limit is no higher: nothing to show on this host"
    assert soft == hard or (hard == resource.RLIM_INFINITY and soft > SOFT), (soft, hard)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell's background job inherits


def test_a_process_started_with_sigint_ignored_is_stopped_by_sigint() -> None:
    code = ("import signal, sys, time\n"
            "from bear.runtime.process import prepare_process\n"
            "inherited = signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
            "prepare_process()\n"
            "try:\n"  # 'ready' inside: a SIGINT landing as its write returns is caught too (a race CI lost)
            "    print('ready', inherited, flush=True)\n"
            "    time.sleep(3600)\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted', flush=True)\n"
            "    sys.exit(130)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, preexec_fn=_ignore_sigint)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().split() == ["ready", "True"]  # it did start with SIGINT ignored
        p.send_signal(signal.SIGINT)
        assert p.wait(HANG_S) == 130
        assert p.stdout.read().strip() == "interrupted"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
