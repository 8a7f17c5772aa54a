"""Claude Code (npm ``@anthropic-ai/claude-code``) for the tests: installed once into a cache
directory, run in print mode (``claude -p``) against a Kiln gateway with a Kiln key.

Its settings are Claude Code's documented environment variables
(https://docs.claude.com/en/docs/claude-code/settings#environment-variables): the base URL and
the bearer token, the model for every request (``ANTHROPIC_MODEL`` and the small, fast model),
no telemetry, error reporting, auto-update or other non-essential traffic (the tests run with
no network but the package registries), a fresh ``HOME`` so no user's settings apply.

Run standalone to install it: ``python tests/support/claude_code.py install``.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "@anthropic-ai/claude-code"
# The version the tests run: each release changes what it sends (docs/MESSAGES.md, "Claude
# Code"), so a new one is taken on purpose, with the docs, not by whoever installs last.
VERSION = "2.1.332"
CACHE_DIR = Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln")) / "npm"
BINARY = CACHE_DIR / "node_modules" / ".bin" / "claude"
MANIFEST = CACHE_DIR / "node_modules" / "@anthropic-ai" / "claude-code" / "package.json"


def installed():
    """The ``claude`` executable of :data:`VERSION`, installing it first when the cache holds
    no such one; None when npm itself is absent (the test is then skipped)."""
    if BINARY.exists() and _cached_version() == VERSION:
        return BINARY
    npm = shutil.which("npm")
    if npm is None:
        return None
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # The package's postinstall only copies the native binary of this platform over its
    # placeholder; npm installs that binary as an optional dependency either way.
    subprocess.run([npm, "install", "--prefix", str(CACHE_DIR), "--no-audit", "--no-fund",
                    "--loglevel=error", f"{PACKAGE}@{VERSION}"], check=True, timeout=600,
                   stdin=subprocess.DEVNULL)
    return BINARY if BINARY.exists() and _cached_version() == VERSION else None


def _cached_version():
    try:
        return json.loads(MANIFEST.read_text()).get("version")
    except (OSError, ValueError):
        return None


def environment(base_url, key, model, home):
    """Claude Code's environment: Kiln as its API, ``model`` for every request."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    return {
        **keep,
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(Path(home) / ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_BUG_COMMAND": "1",
        "DISABLE_COST_WARNINGS": "1",
        "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
        # one try per request: a failure must show as a failure here, not as retries
        "CLAUDE_CODE_MAX_RETRIES": "0",
        "API_TIMEOUT_MS": "120000",
    }


def run(binary, base_url, key, model, prompt, cwd=None, args=(), timeout_s=240):
    """Run ``claude -p PROMPT`` against Kiln; return the CompletedProcess (text output).

    :param cwd: the session's working directory (a fresh temporary one by default).
    """
    home = tempfile.mkdtemp(prefix="claude-home-")
    cwd = cwd or tempfile.mkdtemp(prefix="claude-cwd-")
    return subprocess.run([str(binary), "-p", prompt, *args], cwd=cwd,
                          env=environment(base_url, key, model, home), capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: claude_code.py install")
    path = installed()
    print(path or "npm is absent: Claude Code not installed")
