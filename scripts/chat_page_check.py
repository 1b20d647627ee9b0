#!/usr/bin/env python3
"""Drives the chat panel of a member's page (`GET /`) in headless Chromium and checks what it shows.

Usage:
    python3 scripts/chat_page_check.py http://127.0.0.1:8080/v1 [--out DIR] [--screenshot PNG]

Given the tracker's OpenAI base URL (the last line of `testnet/local.sh up`), it opens the page
in Chromium, controlled over the DevTools protocol on a pipe (`--remote-debugging-pipe`, no
extra packages), and, as a user would, types questions and presses Enter or clicks. It checks
from the page's DOM and the requests the page sends that

- with temperature 0 the answer streams in (the text grows in several steps before the stream
  ends) and equals the text of the same conversation asked non-streamed of the API;
- the answer's figures are plausible: time to first token within the time the answer took,
  tokens/s positive, the token count the API's usage gives, and the members named are the route
  the API's `X-Meshnet-Route` header gave, covering layers 0 to the model's last from the
  tracker on, each with the span `/status` gives it;
- the second turn sends the first (system prompt, question, answer) again, and its answer is
  the API's for the whole conversation; "New chat" forgets it;
- errors are shown in words: a 400 (max tokens 0) with the API's message, a stream that ends
  with an error event and one cut off before `[DONE]` (both served by the test in place of the
  API) — and model text is shown as text, never as markup.

It saves a screenshot of the conversation (desktop size) to --screenshot (default
OUT/chat-desktop.png) and one at phone size under --out (default target/test-output/chat-page).
Needs `chromium` (Debian's package; scripts/setup.sh --dev).
"""

import argparse
import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from page_check import CheckFailed, check, chromium_binary

# Real time a generation in the page may take (a debug build on a busy two-core machine).
ANSWER_TIMEOUT_S = 180
# Real time the page may take to load and read /status once.
LOAD_TIMEOUT_S = 30
# Real time one DevTools command may take.
COMMAND_TIMEOUT_S = 30
# Tokens per answer: enough that the stream spans many network reads.
MAX_TOKENS = 48
SYSTEM_PROMPT = "You are a helpful assistant. Answer in one or two sentences."
QUESTIONS = ["What is the capital of France?", "What is it famous for?"]


class DevTools:
    """Chromium run headless with the DevTools protocol on fds 3 and 4 (NUL-ended JSON)."""

    def __init__(self, binary, profile, log_path):
        to_browser = [self._high(fd) for fd in os.pipe()]
        from_browser = [self._high(fd) for fd in os.pipe()]

        def give_pipes():  # in the child, before exec: the protocol's fds
            os.dup2(to_browser[0], 3)
            os.dup2(from_browser[1], 4)

        self.log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--hide-scrollbars", "--remote-debugging-pipe",
             f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            close_fds=False, preexec_fn=give_pipes,
        )
        os.close(to_browser[0])
        os.close(from_browser[1])
        self.writer = os.fdopen(to_browser[1], "wb", buffering=0)
        self.reader = os.fdopen(from_browser[0], "rb", buffering=0)
        self.next_id = 0
        self.replies = {}
        self.events = queue.Queue()
        self.lock = threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, daemon=True).start()
        self.session = None

    @staticmethod
    def _high(fd):
        """`fd` moved above 4 (close-on-exec), so that the child's dup2 onto 3 and 4 copies it."""
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(fd)
        return moved

    def _read(self):
        buffer = b""
        while True:
            data = self.reader.read(65536)
            if not data:
                break
            buffer += data
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    with self.lock:
                        self.replies[message["id"]] = message
                        self.lock.notify_all()
                else:
                    self.events.put(message)
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def call(self, method, params=None, session=True):
        """Sends a command (to the page's session unless `session` is False) and returns its
        result."""
        with self.lock:
            self.next_id += 1
            ident = self.next_id
        message = {"id": ident, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        self.writer.write(json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        with self.lock:
            while ident not in self.replies:
                check(not self.closed, f"Chromium closed the DevTools pipe during {method}")
                left = deadline - time.monotonic()
                check(left > 0, f"Chromium did not answer {method} within {COMMAND_TIMEOUT_S} s")
                self.lock.wait(left)
            reply = self.replies.pop(ident)
        check("error" not in reply, f"{method} failed: {reply.get('error')}")
        return reply["result"]

    def open_page(self, url, width, height):
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)
        self.session = self.call("Target.attachToTarget",
                                 {"targetId": target["targetId"], "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            self.call(f"{domain}.enable")
        self.resize(width, height)
        self.call("Page.navigate", {"url": url})

    def resize(self, width, height):
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1,
                   "mobile": width < 600})

    def evaluate(self, expression):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        details = result.get("exceptionDetails")
        check(details is None, f"the page threw evaluating {expression!r}: {details}")
        return result["result"].get("value")

    def wait_for(self, expression, timeout, what):
        """Polls `expression` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            check(time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.05)

    def drain_events(self):
        """Every protocol event received so far."""
        drained = []
        while True:
            try:
                drained.append(self.events.get_nowait())
            except queue.Empty:
                return drained

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        check(os.path.getsize(path) > 0, f"the screenshot {path} is empty")

    def close(self):
        try:
            if not self.closed:
                self.call("Browser.close", session=False)
            self.process.wait(timeout=10)
        except (CheckFailed, subprocess.TimeoutExpired, OSError):
            self.process.kill()
            self.process.wait()
        finally:
            self.log.close()


class Chat:
    """The chat panel, driven as a user would."""

    # Records, for each mutation batch of the log, the last answer's text length and state.
    WATCH = """(() => {
      window.answerGrowth = [];
      new MutationObserver(() => {
        const m = [...document.querySelectorAll("#chat-log .msg.assistant")].pop();
        if (m) window.answerGrowth.push({len: m.querySelector(".text").textContent.length,
                                        state: m.dataset.state});
      }).observe(document.getElementById("chat-log"),
                 {subtree: true, childList: true, characterData: true, attributes: true});
      return true;
    })()"""

    # The last answer as the page shows it.
    LAST_ANSWER = """(() => {
      const m = [...document.querySelectorAll("#chat-log .msg.assistant")].pop();
      if (!m) return null;
      const value = (c) => { const e = m.querySelector(".stats ." + c); return e ? e.dataset.value : null; };
      const error = m.querySelector(".error");
      return {state: m.dataset.state, text: m.querySelector(".text").textContent,
              error: error ? error.textContent : null,
              tps: value("tps"), ttft: value("ttft"), tokens: value("tokens"),
              route: [...m.querySelectorAll(".route li")].map((li) => [li.dataset.peer, li.dataset.layers]),
              markup: m.querySelector(".text").children.length,
              turns: Number(document.getElementById("chat-log").dataset.turns),
              input: document.getElementById("chat-input").value};
    })()"""

    def __init__(self, browser):
        self.browser = browser

    def set_settings(self, system=None, temperature=None, max_tokens=None):
        for element, value in (("chat-system", system), ("chat-temperature", temperature),
                               ("chat-max-tokens", max_tokens)):
            if value is not None:
                self.browser.evaluate(
                    f"document.getElementById({json.dumps(element)}).value = {json.dumps(str(value))}")

    def ask(self, question, press_enter):
        """Types `question`, sends it (Enter or a click on Send) and waits for the answer to end.
        Returns the answer, the text lengths seen while it streamed, and the wall time it
        took in ms."""
        self.browser.evaluate("window.answerGrowth = []; document.getElementById('chat-input').focus()")
        self.browser.call("Input.insertText", {"text": question})
        started = time.monotonic()
        if press_enter:
            for kind in ("keyDown", "keyUp"):
                self.browser.call("Input.dispatchKeyEvent",
                                  {"type": kind, "key": "Enter", "code": "Enter",
                                   "windowsVirtualKeyCode": 13})
        else:
            self.browser.evaluate("document.getElementById('chat-send').click()")
        self.browser.wait_for(
            "(() => { const m = [...document.querySelectorAll('#chat-log .msg.assistant')].pop();"
            " return m && m.dataset.state !== 'streaming'; })()",
            ANSWER_TIMEOUT_S, f"the answer to {question!r}")
        elapsed_ms = (time.monotonic() - started) * 1000
        growth = self.browser.evaluate("window.answerGrowth")
        return self.browser.evaluate(self.LAST_ANSWER), growth, elapsed_ms


def api(member, path, body):
    """POSTs JSON to the API; returns (status, JSON body, route header)."""
    request = urllib.request.Request(f"{member}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S) as response:
            return response.status, json.load(response), response.headers.get("X-Meshnet-Route")
    except urllib.error.HTTPError as error:
        return error.code, json.load(error), error.headers.get("X-Meshnet-Route")


def chat_requests(events):
    """The page's requests to the chat endpoint in `events`: (request id, body)."""
    found = []
    for event in events:
        if event.get("method") != "Network.requestWillBeSent":
            continue
        request = event["params"]["request"]
        if request["url"].endswith("/v1/chat/completions") and request["method"] == "POST":
            found.append((event["params"]["requestId"], json.loads(request["postData"])))
    return found


def route_header_of(events, request_id):
    for event in events:
        if (event.get("method") == "Network.responseReceived"
                and event["params"]["requestId"] == request_id):
            headers = {k.lower(): v for k, v in event["params"]["response"]["headers"].items()}
            return headers.get("x-meshnet-route")
    raise CheckFailed(f"no response seen for request {request_id}")


def check_answer(answer, growth, elapsed_ms, reference, what):
    """The streamed answer equals the API's non-streamed one and its figures are plausible."""
    check(answer["state"] == "done", f"{what}: the answer ended as {answer['state']}: {answer['error']}")
    expected = reference["choices"][0]["message"]["content"]
    check(expected, f"{what}: the API's answer is empty, nothing to compare")
    check(answer["text"] == expected,
          f"{what}: the page shows {answer['text']!r}, the API answers {expected!r}")
    check(answer["markup"] == 0, f"{what}: the answer holds elements")
    streaming = [g["len"] for g in growth if g["state"] == "streaming" and g["len"] > 0]
    check(len(set(streaming)) >= 2,
          f"{what}: the text did not grow in steps while streaming (lengths seen: {streaming})")
    check(streaming == sorted(streaming) and streaming[-1] <= len(expected),
          f"{what}: the streamed text did not only grow: {streaming}")
    tokens = reference["usage"]["completion_tokens"]
    check(answer["tokens"] == str(tokens),
          f"{what}: the page counts {answer['tokens']} tokens, the API's usage {tokens}")
    ttft = float(answer["ttft"])
    check(0 < ttft < elapsed_ms, f"{what}: time to first token {ttft} ms, the answer took {elapsed_ms:.0f} ms")
    tps = float(answer["tps"])
    # (tokens - 1) tokens came after the first, within the time the whole answer took.
    check((tokens - 1) / (elapsed_ms / 1000) <= tps < 10000,
          f"{what}: {tps} tokens/s for {tokens} tokens in {elapsed_ms:.0f} ms")
    return tokens, ttft, tps


def check_route(answer, header, status, layers, what):
    """The members the page names are the header's, and the route /status implies."""
    named = [f"{peer}:{span}" for peer, span in answer["route"]]
    check(header and named == [item.strip() for item in header.split(",")],
          f"{what}: the page names {named}, the X-Meshnet-Route header is {header!r}")
    spans = {status["peer"]: status["span"]["layers"]}
    for peer in status.get("peers", []):
        if peer.get("span"):
            spans[peer["peer"]] = peer["span"]["layers"]
    check(answer["route"][0][0] == status["peer"], f"{what}: the route does not start at the tracker")
    position = 0
    for peer, span in answer["route"]:
        start, end = (int(x) for x in span.split(".."))
        check(start == position, f"{what}: the route {named} skips or repeats layers at {position}")
        check(peer in spans and spans[peer][0] <= start and end <= spans[peer][1],
              f"{what}: {peer} runs {span} but holds {spans.get(peer)}")
        position = end
    check(position == layers, f"{what}: the route {named} ends at layer {position}, not {layers}")


def answer_paused_request(browser, body, status):
    """Answers the page's chat request, paused by Fetch.enable, with `body` (server-sent
    events) in place of the API."""
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while time.monotonic() < deadline:
        for event in browser.drain_events():
            if event.get("method") == "Fetch.requestPaused":
                browser.call("Fetch.fulfillRequest", {
                    "requestId": event["params"]["requestId"], "responseCode": status,
                    "responseHeaders": [{"name": "Content-Type", "value": "text/event-stream"}],
                    "body": base64.b64encode(body.encode()).decode()})
                browser.call("Fetch.disable")
                return
        time.sleep(0.02)
    raise CheckFailed("the page sent no chat request to intercept")


def chunk(**delta):
    return "data: " + json.dumps({"object": "chat.completion.chunk",
                                  "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def fake_stream_errors(browser):
    """A stream that fails midway and one cut off: the partial text stays, as text, and the
    error is shown in words."""
    markup = "<b>bold</b> & <img src=x onerror=alert(1)>"
    cases = [
        ("an error event midway",
         [chunk(role="assistant", content=""), chunk(content=markup),
          'data: {"error": {"message": "peer 12D3KooWX failed", "type": "server_error", '
          '"param": null, "code": "upstream_error"}}'],
         "Error: the generation failed midway: peer 12D3KooWX failed"),
        ("a stream cut before [DONE]",
         [chunk(role="assistant", content=""), chunk(content=markup)],
         "Error: the answer stream ended before it finished"),
    ]
    for what, events, shown in cases:
        browser.call("Fetch.enable", {"patterns": [{"urlPattern": "*/v1/chat/completions"}]})
        browser.drain_events()
        browser.evaluate("document.getElementById('chat-input').focus()")
        browser.call("Input.insertText", {"text": "Tell me more."})
        browser.evaluate("document.getElementById('chat-send').click()")
        answer_paused_request(browser, "\n\n".join(events) + "\n\n", 200)
        browser.wait_for("(() => { const m = [...document.querySelectorAll('#chat-log .msg.assistant')].pop();"
                         " return m && m.dataset.state !== 'streaming'; })()",
                         LOAD_TIMEOUT_S, what)
        answer = browser.evaluate(Chat.LAST_ANSWER)
        check(answer["state"] == "error", f"{what}: the answer ended as {answer['state']}")
        check(answer["error"] == shown, f"{what}: the page shows {answer['error']!r}, expected {shown!r}")
        check(answer["text"] == markup and answer["markup"] == 0,
              f"{what}: the partial text is {answer['text']!r} with {answer['markup']} elements")
        check(answer["input"] == "Tell me more.", f"{what}: the question was not put back to retry")
        browser.evaluate("document.getElementById('chat-input').value = ''")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url", help="the tracker's OpenAI base URL, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--out", default="target/test-output/chat-page", help="where screenshots go")
    parser.add_argument("--screenshot", help="the desktop screenshot (default OUT/chat-desktop.png)")
    args = parser.parse_args()
    member = args.base_url.rstrip("/").removesuffix("/v1")
    os.makedirs(args.out, exist_ok=True)
    screenshot = args.screenshot or os.path.join(args.out, "chat-desktop.png")
    profile = tempfile.mkdtemp(prefix="meshnet-chromium-")
    browser = None
    try:
        with urllib.request.urlopen(f"{member}/status", timeout=10) as response:
            status = json.load(response)
        layers = status["model"]["layers"]
        model = status["model"]["id"]
        browser = DevTools(chromium_binary(), profile, os.path.join(args.out, "chromium.log"))
        browser.open_page(f"{member}/", 1400, 1000)
        browser.wait_for("!!document.documentElement && Number(document.documentElement.dataset.updated) >= 1", LOAD_TIMEOUT_S,
                         "the page to read /status")
        browser.evaluate(Chat.WATCH)
        chat = Chat(browser)
        browser.evaluate("document.getElementById('chat-settings').open = true")
        chat.set_settings(system=SYSTEM_PROMPT, temperature=0, max_tokens=MAX_TOKENS)

        # Two turns, the second carrying the first.
        conversation = [{"role": "system", "content": SYSTEM_PROMPT}]
        figures = []
        for turn, question in enumerate(QUESTIONS):
            browser.drain_events()
            answer, growth, elapsed_ms = chat.ask(question, press_enter=turn == 0)
            events = browser.drain_events()
            requests = chat_requests(events)
            check(len(requests) == 1, f"turn {turn + 1}: {len(requests)} chat requests")
            request_id, sent = requests[0]
            conversation.append({"role": "user", "content": question})
            check(sent["messages"] == conversation,
                  f"turn {turn + 1}: the page sent {sent['messages']}, expected {conversation}")
            check(sent["temperature"] == 0 and sent["max_tokens"] == MAX_TOKENS and sent["stream"]
                  and sent["stream_options"] == {"include_usage": True} and sent["model"] == model,
                  f"turn {turn + 1}: the request's settings are {sent}")
            code, reference, _ = api(member, "/v1/chat/completions", {
                "model": model, "messages": conversation, "temperature": 0,
                "max_tokens": MAX_TOKENS})
            check(code == 200, f"turn {turn + 1}: the API answered {code}: {reference}")
            what = f"turn {turn + 1}"
            figures.append(check_answer(answer, growth, elapsed_ms, reference, what))
            check_route(answer, route_header_of(events, request_id), status, layers, what)
            check(answer["turns"] == turn + 1, f"{what}: the log counts {answer['turns']} turns")
            conversation.append({"role": "assistant", "content": answer["text"]})
        browser.screenshot(screenshot)
        browser.resize(390, 844)
        browser.evaluate("document.getElementById('chat').scrollIntoView()")
        browser.screenshot(os.path.join(args.out, "chat-phone.png"))
        browser.resize(1400, 1000)

        # A request the API refuses: its message, in words; the turn is not kept.
        chat.set_settings(max_tokens=0)
        answer, _, _ = chat.ask("Hi", press_enter=False)
        code, refusal, _ = api(member, "/v1/chat/completions", {
            "model": model, "messages": conversation + [{"role": "user", "content": "Hi"}],
            "temperature": 0, "max_tokens": 0})
        check(code == 400, f"max_tokens 0: the API answered {code}")
        expected = f"Error: HTTP 400: {refusal['error']['message']} (parameter max_tokens)"
        check(answer["state"] == "error" and answer["error"] == expected,
              f"max_tokens 0: the page shows {answer['state']} {answer['error']!r}, expected {expected!r}")
        check(answer["turns"] == len(QUESTIONS) and answer["input"] == "Hi",
              f"max_tokens 0: turns {answer['turns']}, input {answer['input']!r}")
        browser.evaluate("document.getElementById('chat-input').value = ''")

        chat.set_settings(max_tokens=MAX_TOKENS)
        fake_stream_errors(browser)

        # "New chat" forgets the conversation: the next request sends only the new question.
        browser.evaluate("document.getElementById('chat-new').click()")
        check(browser.evaluate("document.getElementById('chat-log').children.length") == 0,
              "New chat left messages in the log")
        chat.set_settings(max_tokens=4)
        browser.drain_events()
        answer, _, _ = chat.ask(QUESTIONS[0], press_enter=True)
        check(answer["state"] == "done", f"after New chat: the answer ended as {answer['state']}: {answer['error']}")
        sent = chat_requests(browser.drain_events())
        check(len(sent) == 1 and sent[0][1]["messages"] == conversation[:2],
              f"after New chat the page sent {[body['messages'] for _, body in sent]}")

        print("chat page check passed: " + "; ".join(
            f"turn {i + 1}: {tokens} tokens, first token {ttft:.0f} ms, {tps:.1f} tok/s"
            for i, (tokens, ttft, tps) in enumerate(figures)) + f"; screenshot {screenshot}")
    except CheckFailed as failure:
        sys.exit(f"chat page check FAILED: {failure}")
    except OSError as error:
        sys.exit(f"chat page check FAILED: {error}")
    finally:
        if browser:
            browser.close()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
