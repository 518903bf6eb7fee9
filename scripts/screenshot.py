"""The browser page's picture for docs/serving.md: starts `trt-spec serve` on ENGINE, opens
its page (GET /) in headless Chromium, sends one prompt with "side by side with plain" on,
and saves the window once both answers and their comparison are in.

    python scripts/screenshot.py --engine engines/smollm2-135m --out docs/img/serving-page.png

Needs Chromium, chromedriver (apt-get install chromium chromium-driver) and selenium (the
dev extra). Greedy (temperature 0): the same engine draws the same answer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, wait_healthy  # noqa: E402  (scripts/ sits beside this file)

PROMPT = "What are three good reasons to learn to cook at home? Answer as a numbered list."
WAIT_S = 180
MODEL = "smollm2"  # --served-model-name


def browser(width: int, height: int):
    """Headless Chromium at width x height CSS pixels (scale 1), from PATH."""
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                  "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        raise SystemExit("no Chromium or chromedriver on PATH: apt-get install chromium "
                         "chromium-driver")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-device-scale-factor=1",
                "--hide-scrollbars"):
        options.add_argument(arg)
    options.binary_location = binary
    return webdriver.Chrome(service=Service(driver), options=options)


def warm_up(url: str, method: str) -> None:
    """One short answer with the method and one without: the figures in the picture are
    those of a warm server (the first requests pay the graphs' first runs)."""
    import httpx

    for spec in ({"method": method}, {"method": "none"}):
        httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16, "speculative": spec}).raise_for_status()


def shoot(url: str, args) -> None:
    """Sends the prompt side by side and saves the window once #compare is in."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    d = browser(args.width, args.height)
    try:  # the viewport itself at width x height (the window's frame left out)
        d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": args.width, "height": args.height, "deviceScaleFactor": 1, "mobile": False})
        d.get(f"{url}/")
        wait = WebDriverWait(d, WAIT_S)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#method option")) > 1)
        Select(d.find_element(By.ID, "method")).select_by_value(args.method)
        for field, value in (("k", args.k), ("temperature", "0"),
                             ("max-tokens", str(args.max_tokens))):
            d.find_element(By.ID, field).clear()
            d.find_element(By.ID, field).send_keys(value)
        d.find_element(By.ID, "side-by-side").click()
        d.find_element(By.ID, "prompt").send_keys(args.prompt)
        d.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.ID, "compare"))
        time.sleep(2.5)  # one /metrics poll after the answers: the server panel is current
        d.execute_script("document.querySelector('#conversation').scrollTop = 0")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        d.save_screenshot(str(args.out))
    finally:
        d.quit()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("docs/img/serving-page.png"))
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--method", default="hybrid", help="one the engine serves")
    ap.add_argument("--k", default="4", help="num_draft_tokens ('' : the server's default)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1080)
    args = ap.parse_args(argv)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trt_spec.cli", "serve", "--engine",
                             args.engine, "--port", str(port), "--served-model-name", MODEL])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        warm_up(url, args.method)
        shoot(url, args)
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
