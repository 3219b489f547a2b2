"""Takes docs/images/web.png: ``joblock web`` in headless chromium, against a throwaway
Redis holding locks of every kind (plain, fenced, counting, readers, with waiters).

    python scripts/web_screenshot.py [docs/images/web.png]

Needs Debian's chromium and chromium-driver and the `test` extra (selenium, joblock[web]).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

import joblock
from joblock._tools.servers import RedisServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def populate(url: str) -> list[joblock.Locks]:
    """Locks as a busy deployment holds them; the clients that hold them (close them after)."""
    locks = joblock.Locks(url)
    for product in (42, 77, 108):
        locks.acquire(locks.key("ProductSalesJob", product), 300 - product, fence=True)
    locks.acquire(locks.key("CleanupDataJob"), 240)
    for _ in range(2):
        locks.acquire(locks.key("ExportJob", "daily"), 600, limit=3)
    for _ in range(3):
        locks.acquire(locks.key("CatalogSync"), 45, shared=True)
    waiting = [joblock.Locks(url) for _ in range(2)]
    for client, options in zip(waiting, ({}, {"fair": True})):
        key = locks.key("CleanupDataJob")
        threading.Thread(
            target=client.acquire, args=(key, 60), kwargs={"wait": 90, **options}, daemon=True
        ).start()
        time.sleep(0.3)
    return [locks, *waiting]


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "images", "web.png")
    with RedisServer() as server:
        clients = populate(server.url)
        command = subprocess.Popen(
            [sys.executable, "-m", "joblock", "web", "--port", "0", "--allow-release"],
            env={**os.environ, "REDIS_URL": server.url},
            stdout=subprocess.PIPE,
            text=True,
        )
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for argument in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--window-size=1200,1150",
        ):
            options.add_argument(argument)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            found = re.search(r" on (http://\S+?)/ ", command.stdout.readline())  # type: ignore[union-attr]
            assert found
            driver.get(found.group(1) + "/")
            time.sleep(3)  # the first fetch, drawn
            driver.save_screenshot(out)
        finally:
            driver.quit()
            command.terminate()
            command.wait(30)
            for client in clients:
                client.close()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
