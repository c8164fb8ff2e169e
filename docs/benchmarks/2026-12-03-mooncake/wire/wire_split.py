"""Where a routed request's time goes between Envoy and the sidecar, from packets on `lo`.

    python3 wire_split.py capture SECONDS OUT.txt     # as root, while a bench run goes
    python3 wire_split.py split OUT.txt SIDECAR_PORT LISTENER_PORT ENGINE_PORT[,...]

`capture` records every TCP payload packet on the loopback interface with its kernel
timestamp (AF_PACKET, SO_TIMESTAMPNS; no tcpdump needed). `split` pairs each
`POST /v1/route…` Envoy sends the sidecar with the sidecar's answer on the same connection,
and reports, for short prompts (`/v1/route`, tokenized in Envoy) and offloaded ones
(`/v1/route_body`): the last client packet before the call → the call (Envoy and the filter
before asking), the call → the answer (the sidecar, at the wire), and the answer → Envoy's
next `POST` to an engine (Envoy and the filter after it). Arrivals must be sparse enough that
"the last client packet before the call" is the same request's (true of the Mooncake window).
"""

import bisect
import socket
import statistics
import struct
import sys
import time

SO_TIMESTAMPNS = 35


def capture(seconds, path):
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))
    s.bind(("lo", 0))
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    s.settimeout(0.2)
    end = time.time() + seconds
    with open(path, "w") as out:
        while time.time() < end:
            try:
                data, anc, _, addr = s.recvmsg(65536, 64)
            except socket.timeout:
                continue
            if addr[2] == socket.PACKET_OUTGOING:  # on lo every packet is seen twice
                continue
            ts = next((sum(x / f for x, f in zip(struct.unpack("qq", d[:16]), (1, 1e9)))
                       for _, typ, d in anc if typ == SO_TIMESTAMPNS), None)
            ip = data[14:]
            if ts is None or len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
                continue
            tcp = ip[(ip[0] & 15) * 4:]
            sport, dport = struct.unpack("!HH", tcp[:4])
            payload = tcp[(tcp[12] >> 4) * 4:]
            if payload:
                out.write("%.6f %d %d %d %r\n" % (ts, sport, dport, len(payload), payload[:24]))


def split(path, sidecar, listener, engines):
    rows = []
    for line in open(path):
        t, sport, dport, _, payload = line.split(" ", 4)
        rows.append((float(t), int(sport), int(dport), payload.strip()))
    client_in = [t for t, _, d, _ in rows if d == listener]
    to_engine = [t for t, _, d, p in rows if d in engines and p.startswith("b'POST ")]
    calls, spans = {}, {"route": [], "route_body": []}
    for t, sport, dport, p in rows:
        if dport == sidecar and p.startswith("b'POST /v1/route"):
            calls[sport] = (t, "route_body" if "route_body" in p else "route")
        elif sport == sidecar and p.startswith("b'HTTP/1.1 200") and dport in calls:
            asked, kind = calls.pop(dport)
            i, j = bisect.bisect_left(client_in, asked) - 1, bisect.bisect_left(to_engine, t)
            if i >= 0 and j < len(to_engine):
                spans[kind].append((asked - client_in[i], t - asked, to_engine[j] - t))
    for kind, v in spans.items():
        if v:
            before, sidecar_ms, after = (statistics.median(x) * 1e3 for x in zip(*v))
            print(f"{kind}: {len(v)} calls; medians: before the call {before:.2f} ms, "
                  f"the sidecar at the wire {sidecar_ms:.2f} ms, answer to engine {after:.2f} ms")


if __name__ == "__main__":
    if sys.argv[1] == "capture":
        capture(float(sys.argv[2]), sys.argv[3])
    else:
        split(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), {int(p) for p in sys.argv[5].split(",")})
