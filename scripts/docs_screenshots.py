"""Screenshots of the built site (site/, `make docs`) with headless Chromium, for the docs.

The site is served on a free local port and each page is drawn at a laptop's window size
into docs/assets/: the home page and one how-to guide. Chromium comes from the system
(Debian: `apt-get install chromium`); without it the script says so and exits 1.

    make docs-screenshots                      # builds the site first
    python scripts/docs_screenshots.py         # site/ built already
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
ASSETS = ROOT / "docs" / "assets"
# (page of the site, image under docs/assets/)
SHOTS = (("", "home.png"), ("how-to/evaluate-predict-export/", "how-to.png"))
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WINDOW = "1280,860"


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def shoot(chromium: str, url: str, out: Path, profile: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", f"--user-data-dir={profile}", f"--window-size={WINDOW}",
         f"--screenshot={out}", url],
        check=True, capture_output=True, timeout=120,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=SITE, help="the built site (default: site/)")
    parser.add_argument("--out", type=Path, default=ASSETS, help="where the images go")
    args = parser.parse_args(argv)
    chromium = browser()
    if chromium is None:
        print("docs_screenshots: no Chromium found (apt-get install chromium)")
        return 1
    if not (args.site / "index.html").exists():
        print(f"docs_screenshots: {args.site} holds no built site: run make docs")
        return 1
    handler = functools.partial(_QuietHandler, directory=str(args.site))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server, \
            tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        for page, name in SHOTS:
            shoot(chromium, f"http://127.0.0.1:{port}/{page}", args.out / name, Path(profile))
            print(f"wrote {args.out / name}")
        server.shutdown()
    return 0


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
