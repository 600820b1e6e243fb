"""The entry point: every user mistake ends in a one-paragraph error and an exit code, never a traceback; a stop signal stops the processes a command started."""
import os
import sys

import click

from kfp_pytorch.components.errors import KfpPytorchError

from ._app import cli


class _Terminated(BaseException):
    """SIGTERM or SIGHUP: the run is being stopped from outside (kill, timeout, a CI cancel)."""


_HANDLER_PID: int | None = None
"""The process that installed :func:`_stop_descendants`: a forked child (a simulation worker)
inherits the handler, and must not run it."""


def _stop_descendants(signum: int, frame) -> None:
    """Pass the signal on to every process this command started, then end it: kfp.local's task
    processes, and through them the torchrun workers, would otherwise run on, orphaned (Ctrl-C
    reaches the whole terminal group; a kill reaches this process only)."""
    import signal

    signal.signal(signum, signal.SIG_IGN)  # first: a second signal (timeout sends two) does not interrupt the clean-up
    if os.getpid() != _HANDLER_PID:  # a forked child: end as the signal's default would, without a traceback
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    import multiprocessing
    import time

    import psutil  # imported by main() already: an import here could be one the signal interrupted

    # multiprocessing's own children (a simulation pool's workers) are left for it to reap: one
    # reaped here is "still running" to it for ever (its poll() reads ECHILD so), and the pool's
    # shutdown then spins waiting for it
    pooled = {p.pid: p for p in multiprocessing.active_children()}
    kids = psutil.Process().children(recursive=True)
    for kid in kids:
        try:
            kid.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    deadline = time.monotonic() + 15  # the train step takes its workers down first
    _, alive = psutil.wait_procs([k for k in kids if k.pid not in pooled], timeout=15)
    for kid in alive:
        try:
            kid.kill()
        except psutil.Error:
            pass
    for p in pooled.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    raise _Terminated(signum)


def main(argv: list[str] | None = None) -> int:  # noqa: D103
    import signal

    import multiprocessing  # noqa: F401  (for the handler, as psutil)

    import psutil  # noqa: F401  (for the handler: importing it in the handler could meet a half-done import)

    global _HANDLER_PID
    _HANDLER_PID = os.getpid()
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler is signal.SIG_DFL:
            signal.signal(sig, _stop_descendants)
    try:
        return _main(argv, debug)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(argv: list[str] | None, debug: bool) -> int:
    try:
        cli.main(args=argv, prog_name="kfp-pytorch", standalone_mode=False)
        return 0
    except _Terminated as e:
        click.echo(f"kfp-pytorch: stopped by signal {e.args[0]}; the processes it started were stopped too",
                   err=True)
        return 128 + e.args[0]
    except KfpPytorchError as e:
        if debug:
            raise
        click.secho(f"Error: {e}", fg="red", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except OSError as e:  # the machine, not the input: a full disk, a vanished path, a refused connection
        if debug:
            raise
        where = " ".join(f"{f}" for f in (e.filename, e.filename2) if f)
        click.secho(f"Error: {e.strerror or e}" + (f": {where}" if where else ""), fg="red", err=True)
        hint = ("check that the server is up and reachable" if isinstance(e, ConnectionError)
                else "check that path, its permissions and the free disk space")
        click.echo(f"  hint: {hint} (--debug shows the traceback)", err=True)
        return 1
