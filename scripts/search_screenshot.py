"""Take the README's screenshot of the search page (docs/search.png) in headless Chromium.

    demind-index --images runs/quickstart/benchmarks/cirr/dev --index runs/quickstart/search-index --checkpoint CKPT
    PYTHONPATH=. .venv/bin/python scripts/search_screenshot.py --index runs/quickstart/search-index \\
        --checkpoint runs/quickstart/train/<backbone>/demind-seed0/demind.safetensors \\
        --reference dev-3-0-img0.png --filter dev-3-0 --text "make the circle red" --out docs/search.png

Needs Chromium and chromedriver (apt-get install -y chromium chromium-driver) and selenium.
"""

from __future__ import annotations

import argparse
import shutil

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from demind.checkpoint import load_backbone_and_model
from demind.search.index import load_index
from demind.search.query import Searcher
from demind.search.server import create_app, start_server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--reference", required=True, help="gallery name to pick as the reference")
    p.add_argument("--text", required=True)
    p.add_argument("--negative", default="", help="what to leave out (searched with the method's DEO variant)")
    p.add_argument("--method", default="demind")
    p.add_argument("--filter", default="", help="gallery filter to type first (the reference must match it)")
    p.add_argument("--out", default="docs/search.png")
    args = p.parse_args()

    backbone, model = load_backbone_and_model(args.checkpoint)
    server, _ = start_server(create_app(Searcher(backbone, model, load_index(args.index))))
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")),
                              options=options)
    try:
        wait = WebDriverWait(driver, 120)
        driver.get(f"http://127.0.0.1:{server.port}/")
        if args.filter:
            driver.find_element(By.ID, "filter").send_keys(args.filter)
        pick = f"#gallery img[data-name='{args.reference}']"
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, pick))
        driver.find_element(By.CSS_SELECTOR, pick).click()
        driver.find_element(By.ID, "text").send_keys(args.text)
        if args.negative:
            driver.find_element(By.ID, "negative").send_keys(args.negative)
        Select(driver.find_element(By.ID, "method")).select_by_value(args.method)
        driver.find_element(By.ID, "search").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#results .hit"))
        wait.until(lambda d: d.execute_script(
            "return [...document.querySelectorAll('img')].every(i => i.hidden || (i.complete && i.naturalWidth > 0))"))
        driver.save_screenshot(args.out)
        print(f"screenshot: {args.out}")
    finally:
        driver.quit()
        server.shutdown()


if __name__ == "__main__":
    main()
