"""Multiplexed token streams without Ray (decode/channels.py, router/mux.py): a request's deltas
come over its router's channel or its own stream, never lost between them; what arrived since
the last read comes out at once; a channel that closes fails its requests as a lost replica
would, and one left idle ends and is opened again by the next request; closing a request's
stream closes its call (the abort)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.decode.channels import Channels
from cluster.engine.outputs import ChannelClosed, StreamStart, TokenDelta
from cluster.router.mux import Mux


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


class Call:
    """A request's own stream (its generate call): items the test puts in; records its closing."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.items.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.closed = True


async def no_cancel(replica: str, request_id: str) -> None:
    raise AssertionError(f"nothing to cancel: {request_id} on {replica}")


def d(text: str, finish: str | None = None) -> TokenDelta:
    return TokenDelta(text, [len(text)], finish_reason=finish)


async def first_request(mux: Mux, replica: str = "d0") -> None:
    """A request to `replica` that finishes on its own stream: the mux subscribes to it on the way."""
    warm = Call()
    w = mux.stream(f"w-{replica}", warm)
    warm.items.put_nowait(StreamStart(replica, False))
    warm.items.put_nowait([d("ok", "stop")])
    await w.__anext__()
    await settle()


async def on_channel(mux: Mux, rid: str) -> tuple[Call, object, asyncio.Future]:
    """`rid` sent to d0, which answers that its deltas come over the channel: (its call, its
    stream, the stream's first read, pending)."""
    call = Call()
    stream = mux.stream(rid, call)
    reading = asyncio.ensure_future(stream.__anext__())
    call.items.put_nowait(StreamStart("d0", True))
    await settle()
    return call, stream, reading


def test_first_on_its_own_stream_then_over_the_channel_several_steps_in_one_read():
    async def go():
        channels = Channels()
        subscribed = []

        def subscribe(replica: str):
            subscribed.append(replica)
            return channels.serve("router-1")

        mux = Mux(subscribe, no_cancel)
        first = Call()
        a = mux.stream("a", first)
        first.items.put_nowait(StreamStart("d0", False))  # no channel there yet: its own stream
        first.items.put_nowait([d("x")])
        got_a = [await a.__anext__()]
        await settle()
        assert subscribed == ["d0"] and "router-1" in channels.open
        second, b, reading = await on_channel(mux, "b")
        channel = channels.open["router-1"]
        channel.put("b", d("he"))
        await settle()
        got_b = [await reading]
        for text in ("ll", "o"):  # two steps before the reader looks again
            channel.put("b", d(text))
            await settle()
        first.items.put_nowait([d("y", "length")])
        got_b.append(await b.__anext__())
        got_a.append(await a.__anext__())
        second.items.put_nowait(None)  # b's own stream ends before its last delta arrives
        await settle()
        channel.put("b", d("!", "stop"))
        got_b.append(await b.__anext__())
        for s in (a, b):
            with pytest.raises(StopAsyncIteration):
                await s.__anext__()
        await mux.close()
        return got_a, got_b, subscribed, channels.open

    got_a, got_b, subscribed, still_open = asyncio.run(go())
    assert [[x.text for x in item] for item in got_a] == [["x"], ["y"]]
    assert [[x.text for x in item] for item in got_b] == [["he"], ["ll", "o"], ["!"]]
    assert subscribed == ["d0"] and still_open == {}  # one subscription; closed with the mux


def test_a_channel_that_closes_fails_its_requests_as_a_lost_replica():
    async def go():
        channels = Channels()
        mux = Mux(lambda replica: channels.serve("r"), no_cancel)
        await first_request(mux)
        call, s, reading = await on_channel(mux, "s")
        channel = channels.open["r"]
        channel.put("s", d("a"))
        first = await reading
        mux.channels["d0"].cancel()  # the subscription is gone
        with pytest.raises(ChannelClosed):
            await s.__anext__()
        await settle()
        with pytest.raises(ChannelClosed):
            channel.put("s", d("b"))  # the decode side sees it too: it fails R there
        return first, call.closed

    first, closed = asyncio.run(go())
    assert [x.text for x in first] == ["a"] and closed


def test_an_idle_channel_ends_without_failing_anything_and_the_next_request_opens_it_again():
    """A channel is a request in flight to Serve: held open while idle, it would keep a decode
    replica being scaled down from draining until Serve's grace period ran out."""
    async def go():
        channels = Channels(idle_close_s=0.05)
        subscribed = []

        def subscribe(replica: str):
            subscribed.append(replica)
            return channels.serve("r")

        mux = Mux(subscribe, no_cancel)
        await first_request(mux)
        call, s, reading = await on_channel(mux, "b")
        channel = channels.open["r"]
        channel.attach("b", asyncio.current_task())  # as the decode replica does while b runs
        await asyncio.sleep(0.15)  # longer than idle, but b is on it: it stays
        open_while_used = "r" in channels.open and "d0" in mux.channels
        channel.put("b", d("done", "stop"))
        got = await reading
        channel.detach("b")  # b finished there
        call.items.put_nowait(None)
        await asyncio.sleep(0.15)
        closed_when_idle = "r" not in channels.open and "d0" not in mux.channels
        nxt = Call()  # the next request finds no channel there: its own stream, and a new subscription
        n = mux.stream("n", nxt)
        nxt.items.put_nowait(StreamStart("d0", False))
        nxt.items.put_nowait([d("again", "stop")])
        again = await n.__anext__()
        await settle()
        reopened = "r" in channels.open
        await mux.close()
        return open_while_used, got, closed_when_idle, again, reopened, subscribed

    open_while_used, got, closed_when_idle, again, reopened, subscribed = asyncio.run(go())
    assert open_while_used and [x.text for x in got] == ["done"] and got[-1].finish_reason == "stop"
    assert closed_when_idle and [x.text for x in again] == ["again"]
    assert reopened and subscribed == ["d0", "d0"]


def test_after_a_pause_the_router_reopens_the_channels_it_used_before_sending_a_request():
    """A burst after a pause: the router subscribes again to the replicas it used lately before the
    burst's first request is sent, so that request finds its channel there; a subscription that
    ends without saying it opened (the replica gone: Serve sent the call to another, which
    refused it) is not asked for again until a request's StreamStart names that replica."""
    async def go():
        channels = Channels(idle_close_s=0.05)
        subscribed = []

        def subscribe(replica: str):
            subscribed.append(replica)
            if replica == "gone":  # Serve sent it to another replica, which ends it at once
                return empty()
            return opened_here(channels.serve("r"))

        async def opened_here(batches):  # as DecodeDeployment.subscribe: an empty batch first
            yield {}
            async for batch in batches:
                yield batch

        async def empty():
            return
            yield

        mux = Mux(subscribe, no_cancel)
        await first_request(mux)  # d0 named by a StreamStart: subscribed
        await asyncio.sleep(0.15)
        closed_when_idle = "d0" not in mux.channels
        mux.reopen()  # the next request is about to be sent
        await settle()
        reopened = "r" in channels.open and "d0" in mux.channels
        call, s, reading = await on_channel(mux, "b")  # its replica's StreamStart: over the channel
        channels.open["r"].put("b", d("hi", "stop"))
        got = await reading
        call.items.put_nowait(None)
        await first_request(mux, "gone")  # a replica whose subscription ends without opening
        forgot = "gone" not in mux.recent and "gone" not in mux.channels
        await asyncio.sleep(0.15)  # another pause: every channel closed while idle
        mux.reopen()
        await settle()
        await mux.close()
        return closed_when_idle, reopened, got, forgot, subscribed

    closed_when_idle, reopened, got, forgot, subscribed = asyncio.run(go())
    assert closed_when_idle and reopened and [x.text for x in got] == ["hi"]
    assert forgot and subscribed == ["d0", "d0", "gone", "d0"]  # d0 again; "gone" not asked for again


def test_requests_right_after_one_that_found_no_channel_expect_its_subscription():
    """A burst after a pause: the first request goes on its own stream (its StreamStart has the
    router subscribe); the ones right behind it expect that channel instead of each taking a
    stream of their own, and get it when it opens; with no subscription coming, they go on their
    own streams when the wait ends, and the next request after that tells the router again."""
    from cluster.decode.channels import SUBSCRIBE_WAIT_S

    async def go():
        channels = Channels()
        first = channels.claim("r")
        behind = [channels.claim("r") for _ in range(3)]
        opening = [asyncio.ensure_future(channels.opened("r")) for _ in behind]
        await settle()
        waiting = not any(t.done() for t in opening)
        batches = channels.serve("r")  # the router's subscription arrives
        reading = asyncio.ensure_future(batches.__anext__())
        await settle()
        got = [await t for t in opening]
        open_now = channels.claim("r")
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await settle()
        teller = channels.claim("r")  # the channel closed: this one tells the router again
        coming = channels.claim("r")
        loop = asyncio.get_running_loop()
        started = loop.time()
        unanswered = await channels.opened("r")  # nobody subscribes this time
        waited = loop.time() - started
        after = channels.claim("r")  # the wait ended: tells it again
        return first, behind, waiting, got, open_now, teller, coming, unanswered, waited, after

    first, behind, waiting, got, open_now, teller, coming, unanswered, waited, after = asyncio.run(go())
    assert first == (None, False) and behind == [(None, True)] * 3 and waiting
    assert all(c is not None and c is got[0] for c in got) and open_now == (got[0], False)
    assert teller == (None, False) and coming == (None, True)
    assert unanswered is None and SUBSCRIBE_WAIT_S - 0.1 < waited < SUBSCRIBE_WAIT_S + 0.2
    assert after == (None, False)


def test_closing_a_stream_closes_its_call_and_an_error_on_it_is_raised():
    async def go():
        mux = Mux(lambda replica: Channels().serve("r"), no_cancel)
        call = Call()
        s = mux.stream("s", call)
        call.items.put_nowait([d("a")])
        await s.__anext__()
        await s.aclose()  # the client went away
        await settle()  # (the abort runs as a task of its own)
        broken = Call()
        t = mux.stream("t", broken)
        broken.items.put_nowait(RuntimeError("engine failed"))
        with pytest.raises(RuntimeError, match="engine failed"):
            await t.__anext__()
        await settle()
        await mux.close()
        return call.closed, broken.closed, mux.waiting

    closed, broken_closed, waiting = asyncio.run(go())
    assert closed and broken_closed and waiting == {}


def test_a_multiplexed_request_closed_early_is_cancelled_on_its_replica_and_a_closed_channel_cancels_its_own():
    """Serve sees a caller's cancel of a stream only on its next write, and a multiplexed
    request's own stream has none: the router calls `cancel` on its replica, and a channel that
    closes cancels the requests still on it (decode side)."""
    async def go():
        channels = Channels()
        cancelled = []

        async def cancel(replica: str, request_id: str) -> None:
            cancelled.append((replica, request_id, channels.cancel(request_id)))

        mux = Mux(lambda replica: channels.serve("r"), cancel)
        await first_request(mux)
        waiting = asyncio.Event()

        async def decoding(rid: str) -> None:  # stands for DecodeServer.generate on the channel path
            channels.open["r"].tasks[rid] = asyncio.current_task()
            await waiting.wait()

        runs = {rid: asyncio.ensure_future(decoding(rid)) for rid in ("s", "t")}
        call, s, reading = await on_channel(mux, "s")
        channels.open["r"].put("s", d("a"))
        await reading
        await s.aclose()  # the client hung up
        await settle()
        await mux.close()  # the router's channel closes: what is still on it is cancelled
        await settle()
        return cancelled, call.closed, {rid: r.cancelled() for rid, r in runs.items()}

    cancelled, closed, runs = asyncio.run(go())
    assert cancelled == [("d0", "s", True)] and closed
    assert runs == {"s": True, "t": True}


def test_a_hang_up_delivered_as_a_cancel_scope_still_aborts_the_request():
    """Starlette streams a response inside an anyio task group: a client's hang-up cancels its
    scope, and anyio delivers that cancellation again at every await until the stream's task
    leaves the scope. The abort of R, on its own stream or on a channel, survives that."""
    import anyio

    async def go():
        channels = Channels()
        cancelled = []

        async def cancel(replica: str, request_id: str) -> None:
            await asyncio.sleep(0)  # a Serve call: it awaits
            cancelled.append((replica, request_id))

        mux = Mux(lambda replica: channels.serve("r"), cancel)
        await first_request(mux)
        calls = {rid: Call() for rid in ("own", "mux")}
        read = {rid: asyncio.Event() for rid in calls}

        async def client(rid: str, scope: anyio.CancelScope) -> None:
            with scope:
                async for _ in mux.stream(rid, calls[rid]):
                    read[rid].set()

        scopes = {rid: anyio.CancelScope() for rid in calls}
        tasks = [asyncio.ensure_future(client(rid, scopes[rid])) for rid in calls]
        calls["own"].items.put_nowait(StreamStart("d0", False))  # no channel: R's tokens on its own stream
        calls["own"].items.put_nowait([d("a")])
        calls["mux"].items.put_nowait(StreamStart("d0", True))
        await settle()
        channels.open["r"].put("mux", d("b"))
        for rid in calls:
            await asyncio.wait_for(read[rid].wait(), 5)
            scopes[rid].cancel()  # the client hung up
        await asyncio.gather(*tasks)
        await settle()
        await mux.close()
        return {rid: c.closed for rid, c in calls.items()}, cancelled, mux.waiting

    closed, cancelled, waiting = asyncio.run(go())
    assert closed == {"own": True, "mux": True}  # each call closed (Serve's own-stream abort)
    assert cancelled == [("d0", "mux")] and waiting == {}  # and the channel's request cancelled on its replica


def test_one_choice_read_without_read_ahead_keeps_several_steps_in_one_delta_and_closing_aborts():
    """The router reads a single choice straight from its multiplexed buffer (merge_samples with
    read_ahead=False, no task reading ahead per request): what arrived while the response was
    busy still goes out as one delta, the finish comes through, and a client that hangs up
    still has its request cancelled on its replica."""
    from cluster.router.streams import merge_samples

    async def go():
        channels = Channels()
        cancelled = []

        async def cancel(replica: str, request_id: str) -> None:
            cancelled.append((replica, request_id))

        mux = Mux(lambda replica: channels.serve("r"), cancel)
        await first_request(mux)
        tasks_before = len(asyncio.all_tasks())
        call, s, reading = await on_channel(mux, "a")
        channel = channels.open["r"]
        channel.put("a", d("he"))
        first = (0, (await reading)[0])  # as the router's first read would have it
        merged = merge_samples([s], read_ahead=False)
        for text in ("ll", "o"):  # two steps before the response looks again
            channel.put("a", d(text))
            await settle()
        second = await merged.__anext__()
        tasks_reading = len(asyncio.all_tasks()) - tasks_before  # the mux's reader of a's call only
        channel.put("a", d("!", "stop"))
        third = await merged.__anext__()
        with pytest.raises(StopAsyncIteration):
            await merged.__anext__()
        call_b = Call()
        hung_up = merge_samples([mux.stream("b", call_b)], read_ahead=False)
        reading_b = asyncio.ensure_future(hung_up.__anext__())
        call_b.items.put_nowait(StreamStart("d0", True))
        await settle()
        channel.put("b", d("x"))
        await reading_b
        await hung_up.aclose()  # the client went away before reading on
        await settle()
        await mux.close()
        return first, second, third, tasks_reading, cancelled, call_b.closed

    first, second, third, tasks_reading, cancelled, closed = asyncio.run(go())
    assert [(j, x.text) for j, x in (first, second, third)] == [(0, "he"), (0, "llo"), (0, "!")]
    assert second[1].token_ids == [2, 1] and third[1].finish_reason == "stop"
    assert tasks_reading == 1
    assert cancelled == [("d0", "b")] and closed
