"""Command line: ``kvgate serve | check-config | sim-engine | demo | bench | bench-proxy``."""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys

from kvgate import __version__
from kvgate.config import ConfigError, add_flags, from_args


def _setup_logging(level: str, process: int | None = None) -> None:
    where = "" if process is None else f"[process {process}]"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s", stream=sys.stderr)


def _load_config(args: argparse.Namespace):
    """The validated Config, or None after printing every error, one line each (the caller exits with 2)."""
    try:
        return from_args(args)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"kvgate: config error: {line}", file=sys.stderr)
        return None


def _cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    if cfg is None:
        return 2
    from kvgate.proxy.processes import ProcessRole, supervise
    role = ProcessRole.from_env(cfg)
    _setup_logging(cfg.log_level, None if role is None else role.index)
    if role is None:  # said once, by the process the user started (its processes get the same config)
        for line in cfg.warnings:
            logging.getLogger("kvgate").warning("config: %s", line)
    if role is None and cfg.workers > 1:
        return supervise(cfg)  # starts cfg.workers kvgate processes on the port and supervises them
    from kvgate.proxy.bootstrap import serve
    return serve(cfg, role)


def _cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    if cfg is None:
        return 2
    for line in cfg.warnings:
        print(f"kvgate: config warning: {line}", file=sys.stderr)
    print(f"{args.config or '(defaults)'}: ok (upstream {cfg.upstream}, session lifecycle "
          f"{'on' if cfg.agentic_session_lifecycle else 'off'}, admission "
          f"{'on' if cfg.agentic_program_admission else 'off'})")
    return 0


class _DefaultsHelp(argparse.HelpFormatter):
    """Help text that shows each flag's default, unless the text already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False) or not action.option_strings:
            return text
        default = action.default
        if isinstance(default, (list, tuple)):
            default = " ".join(map(str, default)) or "none"
        return f"{text} (default: {str(default).replace('%', '%%')})"


class _FlagsHelp(_DefaultsHelp):
    """``serve`` and ``check-config`` help, a flag per config key: an on/off flag shows as ``--[no-]compat-probe``
    (both spellings still work), and on a terminal of 100 columns or more the help starts in column 34, so most
    flags keep their help on their own line, a line shorter each (argparse's column is 24)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        if width is None:
            import shutil
            width = shutil.get_terminal_size().columns - 2  # argparse's own width
        super().__init__(prog, indent_increment, 34 if width >= 98 else max_help_position, width)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, argparse.BooleanOptionalAction) and len(action.option_strings) == 2:
            return "--[no-]" + action.option_strings[0].removeprefix("--")
        return super()._format_action_invocation(action)


class Parser(argparse.ArgumentParser):
    """kvgate's argument parser: no abbreviated flags (``--por`` is not ``--port``), defaults in ``--help``,
    and a "did you mean" for a mistyped flag, as for a mistyped YAML key. Subcommands get the same class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _DefaultsHelp)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras and getattr(ns, "config_file", None) is not None:
            # ``serve --por 8080``: the value of the unknown flag was taken for the config file; it is the flag's
            argv = list(sys.argv[1:] if args is None else args)
            for i, arg in enumerate(argv[:-1]):
                if arg in extras and arg.startswith("-") and "=" not in arg and argv[i + 1] == ns.config_file:
                    extras.insert(extras.index(arg) + 1, ns.config_file)
                    ns.config_file = None
                    break
        if extras:
            parser = self._subparser(ns) or self
            parser.error(unrecognized(extras, parser))
        return ns

    def error(self, message: str):  # type: ignore[override]
        """The one line that says what is wrong, and where the rest is: not argparse's usage first (``serve``'s
        runs to 80 lines, and the line that helps came last), with the closest command for a mistyped one
        (``kvgate sever``: did you mean serve?). Exits with 2."""
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m is not None:
            close = difflib.get_close_matches(m.group(1), re.findall(r"'([^']*)'", m.group(2)), n=2, cutoff=0.6)
            if close:
                message += f" (did you mean {' or '.join(close)}?)"
        self.exit(2, f"{self.prog}: error: {message}\n(every option: {self.prog} --help)\n")

    def _subparser(self, ns: argparse.Namespace) -> "argparse.ArgumentParser | None":
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(ns, action.dest, None) or "")
        return None


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """The error line for arguments ``parser`` does not know, with the closest flag for each mistyped one:
    ``unrecognized arguments: --por 8080 (did you mean --port?)``."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extras:
        if arg.startswith("--"):
            name = arg.partition("=")[0]
            close = difflib.get_close_matches(name, flags, n=2, cutoff=0.75)
            if not close and len(name) > 5:  # a word of a longer flag: --lifecycle, --admission
                close = [f for f in flags if name[2:] in f][:2]
            if close:
                hints.append(f"{arg.partition('=')[0]}: did you mean {' or '.join(close)}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvgate", description="Session- and KV-aware proxy in front of the SGLang router")
    p.add_argument("--version", action="version", version=f"kvgate {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    # every key is a flag: the usage line names the shape, the sections below list them (not 60 lines of [--flag])
    flags_usage = "%(prog)s [-h] [--config FILE] [--FLAG VALUE ...] [config_file]"
    serve = sub.add_parser("serve", help="run the proxy", usage=flags_usage, formatter_class=_FlagsHelp)
    serve.add_argument("config_file", nargs="?", help="YAML config file (as --config)")
    add_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    check = sub.add_parser("check-config", help="validate a config file (and flags) without serving",
                           usage=flags_usage, formatter_class=_FlagsHelp)
    check.add_argument("config_file", nargs="?", help="YAML config file")
    add_flags(check)
    check.set_defaults(func=_cmd_check_config)

    from kvgate.sim import args as sim_cli
    sim = sub.add_parser("sim-engine", help="run a simulated SGLang engine (for tests, demo and bench)")
    sim_cli.add_arguments(sim)
    sim.set_defaults(func=sim_cli.run)

    from kvgate.tools import engine_command
    eng = sub.add_parser("engine", help="start, stop or list real SGLang CPU engines (the ones the tests use)")
    engine_command.add_arguments(eng)
    eng.set_defaults(func=engine_command.run)

    from kvgate.tools import demo
    d = sub.add_parser("demo", help="replay a Mooncake trace slice through kvgate, smg and simulated engines "
                                    "(four by default, see --engines)")
    demo.add_arguments(d)
    d.set_defaults(func=demo.run)

    from kvgate.bench import command as bench_cli
    b = sub.add_parser("bench", help="compare kvgate arms, the plain router and its limiter on KV-bound simulated "
                                     "engines")
    bench_cli.add_arguments(b)
    b.set_defaults(func=bench_cli.run)

    from kvgate.bench import proxy_bench
    pb = sub.add_parser("bench-proxy", help="measure what each proxy hop adds (direct, smg, kvgate arms) with the "
                                            "engines replaced by nginx answering fixed SGLang JSON")
    proxy_bench.add_arguments(pb)
    pb.set_defaults(func=proxy_bench.run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "check-config") and args.config_file:
        if args.config and args.config != args.config_file:
            parser._subparser(args).error(f"two config files: {args.config_file} and --config {args.config}")
        args.config = args.config_file
    if args.command in ("demo", "bench", "bench-proxy"):
        import faulthandler
        import signal

        from kvgate.tools.procs import exit_on_signals
        exit_on_signals()  # they start engines, a router and kvgate: a SIGTERM or SIGHUP must stop those too
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where a stuck run is, on stderr
        try:
            return int(args.func(args) or 0)
        except KeyboardInterrupt:  # Ctrl-C: the children are stopped by then (finally blocks); no traceback
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a further press must not interrupt the exit
            print(f"kvgate {args.command}: interrupted", file=sys.stderr)
            return 130
    return int(args.func(args) or 0)
