"""Start `python main.py serve ...`, ask it one question with the official OpenAI client
(streaming, printed as it arrives), then stop the server with Ctrl-C's signal. What a user of
the server does by hand; nothing of this project is imported.

    python examples/serve_and_ask.py --question "Why is the sky blue?" -- \\
        --config configs/offline.json --checkpoint checkpoints/sft_demo_x
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


LOG = ROOT / "logs" / "serve_demo.log"     # the server's own messages (one line per request)


def start(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    LOG.parent.mkdir(parents=True, exist_ok=True)
    # The server is stopped below with SIGINT: start it with SIGINT's default handling, since a
    # shell starts background jobs (and nohup) with SIGINT ignored, and main.py keeps an
    # ignored signal ignored.
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", "--port", "0", *serve_args],
                            stdout=subprocess.PIPE, stderr=LOG.open("w"), text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    for line in proc.stdout:                     # the first line names the address
        if line.startswith("serve: listening on "):
            return proc, line.split("listening on ", 1)[1].strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    sys.exit(f"the server did not start (exit {proc.wait()}); its messages: {LOG}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question", default="Why is the sky blue?")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then the arguments of main.py serve")
    a = ap.parse_args()
    from openai import OpenAI
    proc, url = start([x for x in a.serve_args if x != "--"])
    try:
        client = OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        print(f"openai client -> {url}/v1, model {model!r}\nuser: {a.question}\nassistant: ", end="", flush=True)
        stream = client.chat.completions.create(model=model, stream=True, max_tokens=a.max_tokens,
                                                temperature=a.temperature, seed=1,
                                                messages=[{"role": "user", "content": a.question}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    print(f"server stopped (exit {code}: 130 is the expected answer to Ctrl-C); its log: {LOG}")
    return 0 if code == 130 else 1


if __name__ == "__main__":
    sys.exit(main())
