"""The ``lora-guard`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lora_guard import __version__
from lora_guard.clock import timer
from lora_guard.demo.personas import PERSONAS


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"ranks must be positive integers, got {text!r}")
    return ranks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lora-guard",
        description="Serve many LoRA adapters on one base model, with guardrails.",
    )
    parser.add_argument("--version", action="version", version=f"lora-guard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "serve",
        help="serve the model and its adapters over HTTP (TGI and OpenAI routes); "
        "`lora-guard serve --help` lists every setting",
        add_help=False,
    )
    commands.add_parser(
        "serve-ray",
        help="serve lora-guard replicas behind Ray Serve with the adapter-affinity router "
        "(needs lora-guard[ray]); `lora-guard serve-ray --help` lists its flags",
        add_help=False,
    )

    _add_demo_commands(commands)

    bench = commands.add_parser(
        "bench",
        help="replay a multi-adapter workload against each serving scheme and print the table",
        description="Replay one seeded trace (or yours, --trace) against static, on-demand, lru, "
        "lora-guard, lora-guard with KV namespaces observed only, and transformers + PEFT; print "
        "memory, swap latency, tail tokens/s, TTFT, hit rate beside Belady, cold-load failures, "
        "KV conflicts and outputs that differ from the oracle. See docs/benchmarks.md.",
    )
    _add_bench_arguments(bench)

    commands.add_parser(
        "simulate",
        help="compare routers over many replicas and adapters in a model calibrated on the "
        "engine (--calibrate measures it); `lora-guard simulate --help` lists the options",
        add_help=False,
    )

    _add_plugins_command(commands)
    return parser


def _add_demo_commands(commands: Any) -> None:
    """prepare-demo, make-adapters and train-adapter."""
    demo = commands.add_parser(
        "prepare-demo",
        help="prepare the demo model (SmolLM2-135M-Instruct), its 24 seeded adapters and "
        "4 personas",
        description="Convert the demo model's GGUF into a safetensors checkpoint and make 24 "
        "seeded demo adapters beside it, with the 4 persona adapters that ship with lora-guard, "
        "under $LORA_GUARD_HOME (default ~/.cache/lora-guard). Idempotent.",
    )
    demo.add_argument(
        "--home", type=Path, help="folder to prepare into (default: $LORA_GUARD_HOME)"
    )

    make = commands.add_parser(
        "make-adapters",
        help="write seeded PEFT LoRA adapters for a Llama-family checkpoint",
        description="Write N real PEFT adapters (peft's own format, init_lora_weights=False, "
        "seeded) varying rank and target modules, into OUT/<prefix>-NN/.",
    )
    make.add_argument("--base", type=Path, required=True, help="Hugging Face checkpoint folder")
    make.add_argument("--out", type=Path, required=True, help="folder to write the adapters into")
    make.add_argument("--n", type=int, default=24, help="number of adapters (default 24)")
    make.add_argument("--ranks", type=_ranks, default=(8, 16, 32, 64), help="default 8,16,32,64")
    make.add_argument("--seed", type=int, default=0, help="default 0")
    make.add_argument("--prefix", default="adapter", help="adapter name prefix (default adapter)")
    make.add_argument(
        "--strength",
        type=float,
        default=0.1,
        help="norm of each update relative to its base weight (default 0.1)",
    )

    train = commands.add_parser(
        "train-adapter",
        help="train a persona LoRA by context distillation (see lora_guard/demo/personas)",
        description="The base model, prompted with the persona's system prompt, answers generated "
        "questions; a LoRA on q/k/v/o_proj learns to give those answers without the prompt. "
        "Writes adapter_model.safetensors, adapter_config.json and training.json into OUT.",
    )
    who = train.add_mutually_exclusive_group(required=True)
    who.add_argument("--persona", choices=sorted(PERSONAS), help="a persona of lora-guard's")
    who.add_argument("--system-prompt", help="your own persona: the system prompt to distill")
    train.add_argument("--out", type=Path, required=True, help="folder to write the adapter into")
    from lora_guard.config import add_engine_flags

    # serve's --model; the demo model must be prepared already (train-adapter does not prepare it)
    add_engine_flags(train, ["model"], shown={"model": "the demo model"})
    train.add_argument("--rank", type=int, default=8, help="LoRA rank, 1 to 16 (default 8)")
    train.add_argument("--steps", type=int, default=80, help="optimizer steps (default 80)")
    train.add_argument("--batch-size", type=int, default=8, help="default 8")
    train.add_argument("--learning-rate", type=float, default=1e-3, help="default 1e-3")
    train.add_argument("--questions", type=int, default=96, help="questions asked (default 96)")
    train.add_argument("--seed", type=int, default=0, help="default 0")
    train.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")


def _add_plugins_command(commands: Any) -> None:
    plugins = commands.add_parser(
        "plugins",
        help="list the plugins that would load, the hooks they implement and their settings",
        description="Build the plugin manager as the engine does (policies, always-on built-ins, "
        "entry points of group lora_guard, --plugin) and print what loaded.",
    )
    plugins.add_argument("--policies", help="hot-set,cold-budget,kv-namespace (default) or lru")
    plugins.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE[:OBJECT]",
        help="load this plugin too (repeatable)",
    )
    plugins.add_argument(
        "--disable-plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="do not load this plugin (repeatable)",
    )


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from lora_guard.bench.arguments import add_arguments

    add_arguments(parser)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    if argv and argv[0] == "serve-ray":
        return _serve_ray(argv[1:])
    if argv and argv[0] == "simulate":
        from lora_guard.simulate import main as simulate

        return simulate(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "prepare-demo":
            return _prepare_demo(args)
        if args.command == "make-adapters":
            return _make_adapters(args)
        if args.command == "train-adapter":
            return _train_adapter(args, argv)
        if args.command == "plugins":
            return _plugins(args)
        if args.command == "bench":
            from lora_guard.bench.run import run

            return run(args, ["bench", *argv[1:]])
    except KeyboardInterrupt:
        return 130
    raise AssertionError(f"unhandled command {args.command}")


def _serve(argv: list[str]) -> int:
    import logging

    from lora_guard.config import SettingsError, load_settings

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = load_settings(argv)
    except SettingsError as exc:
        print(f"lora-guard serve: error: {exc}", file=sys.stderr)
        return 2
    from lora_guard.engine.lora import AdapterError
    from lora_guard.engine.spec import ModelLoadError
    from lora_guard.engine.values import ConfigError
    from lora_guard.plugins import PluginError
    from lora_guard.server.serve import StartError, engine_for, serve

    try:
        engine, keys, adapter_dirs = engine_for(settings)
        return serve(
            engine, settings.host, settings.port, settings.plugin_settings(), keys, adapter_dirs
        )
    except StartError as exc:
        print(f"lora-guard serve: error: {exc}", file=sys.stderr)
        return exc.code
    except (ConfigError, ModelLoadError, AdapterError, PluginError, ValueError) as exc:
        print(f"lora-guard serve: error: {exc}", file=sys.stderr)
        return 1


def _serve_ray(argv: list[str]) -> int:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        print(
            "lora-guard serve-ray: error: Ray Serve is not installed; install lora-guard[ray] "
            "(pip install 'lora-guard[ray]')",
            file=sys.stderr,
        )
        return 2
    from lora_guard.serve_ray.runner import main as serve_ray

    return serve_ray(argv)


def _prepare_demo(args: argparse.Namespace) -> int:
    from lora_guard.demo.model import DemoError, prepare_demo

    started = timer()
    try:
        paths = prepare_demo(args.home)
    except DemoError as exc:
        print(f"lora-guard prepare-demo: error: {exc}", file=sys.stderr)
        return 1
    print(f"demo model:    {paths.model_dir}")
    print(f"demo adapters: {paths.adapter_dir}")
    print(f"ready in {timer() - started:.1f} s")
    return 0


def _make_adapters(args: argparse.Namespace) -> int:
    from lora_guard.demo.adapters import AdapterMakerError, make_adapters

    try:
        shape = {name: getattr(args, name) for name in ("n", "ranks", "seed", "prefix", "strength")}
        folders = make_adapters(args.base, args.out, **shape, log=print)
    except AdapterMakerError as exc:
        print(f"lora-guard make-adapters: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(folders)} adapters to {args.out}")
    return 0


def _train_adapter(args: argparse.Namespace, argv: list[str]) -> int:
    from lora_guard.demo.paths import DemoPaths
    from lora_guard.demo.personas import Persona, persona
    from lora_guard.demo.training import TrainAdapterError, TrainSettings, train_persona

    def fail(message: str) -> int:
        print(f"lora-guard train-adapter: error: {message}", file=sys.stderr)
        return 1

    model = Path(args.model) if args.model is not None else DemoPaths.under().model_dir
    if args.model is None and not (model / "config.json").is_file():
        return fail(
            "the demo model is not prepared: run `lora-guard prepare-demo`, or give --model"
        )
    if args.threads is not None:
        if args.threads < 1:
            return fail(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    if args.persona:
        chosen = persona(args.persona)
    elif not args.system_prompt.strip():
        return fail("--system-prompt must not be empty")
    else:
        chosen = Persona("custom", args.system_prompt, examples=(), keep=lambda _text: True)
    settings = TrainSettings(
        questions=args.questions,
        steps=args.steps,
        batch_size=args.batch_size,
        rank=args.rank,
        alpha=2 * args.rank,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )
    try:
        record = train_persona(model, chosen, args.out, settings, command=argv, log=print)
    except TrainAdapterError as exc:
        return fail(str(exc))
    print(
        f"wrote {args.out}: {record['examples_kept']} examples, loss {record['first_loss']} -> "
        f"{record['final_loss']}, {record['teacher_seconds'] + record['train_seconds']:.0f} s"
    )
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from lora_guard.plugins import Hooks, PluginError, make_plugin_manager

    try:
        hooks = Hooks(make_plugin_manager(args.policies, args.plugin, args.disable_plugin))
    except PluginError as exc:
        print(f"lora-guard plugins: error: {exc}", file=sys.stderr)
        return 1
    for name in hooks.names():
        plugin = hooks.pm.get_plugin(name)
        implemented = sorted(
            impl.name for impl in hooks.pm.get_hookcallers(plugin) or () if impl.get_hookimpls()
        )
        print(f"{name}: {', '.join(implemented) or '(no hooks)'}")
    if hooks.options.options:
        print("settings:")
        for option in hooks.options.options.values():
            print(
                f"  --{option.name.replace('_', '-')} (default {option.default!r}): {option.help}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
