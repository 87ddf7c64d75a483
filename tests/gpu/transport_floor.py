"""The Python gRPC floor for a learner's messages: 33.5 MB (B=2048 T=64 H=128 in bf16) each
way between two Python processes, first over a plain TCP connection, then grpcio both ends (an
echo server) with HTTP/2 window, frame and read-chunk settings; then a Forward of that size from Python to a running rnnd (2048 envs
with 64 recorded steps, e.g. after learner_bench.py's fill), as raw bytes and parsed.

Usage (GPU host or any machine with grpcio): python3 tests/gpu/transport_floor.py RNND_TARGET"""
import sys, time, statistics, subprocess
import numpy as np, grpc
from rnnd.v1 import rnnd_pb2 as pb, rnnd_pb2_grpc as pbg
import rnnd

def med(f, n=5, w=1):
    for _ in range(w): f()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3

M = 64 << 20
BASE = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
OPTS = {
    "default": [],
    "window64M": [("grpc.http2.lookahead_bytes", M)],
    "window64M+frame16M": [("grpc.http2.lookahead_bytes", M), ("grpc.http2.max_frame_size", 16 << 20)],
    "window64M+nobdp": [("grpc.http2.lookahead_bytes", M), ("grpc.http2.bdp_probe", 0)],
    "window64M+readchunk": [("grpc.http2.lookahead_bytes", M), ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20), ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20), ("grpc.experimental.tcp_read_chunk_size", 4 << 20)],
}
srv = r'''
import grpc, sys, json
from concurrent import futures
def h(req, ctx):
    return bytes(int.from_bytes(req[:8], "little"))
s = grpc.server(futures.ThreadPoolExecutor(4), options=json.loads(sys.argv[1]))
s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("e.E", {"Echo": grpc.unary_unary_rpc_method_handler(h)}),))
p = s.add_insecure_port("127.0.0.1:0"); s.start(); print(p, flush=True); s.wait_for_termination()
'''
import json, socket
n = 33554432
# The same bytes over a plain TCP connection between two Python processes: what loopback itself
# costs (the floor of socket regions' data connections).
raw_srv = r'''
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
mv = memoryview(bytearray(1 << 26))
while True:
    h = c.recv(8, socket.MSG_WAITALL)
    if len(h) < 8: break
    k, got = int.from_bytes(h, "little"), 0
    while got < k: got += c.recv_into(mv[got:k], k - got, socket.MSG_WAITALL)
    c.sendall(b"k")
'''
p = subprocess.Popen([sys.executable, "-c", raw_srv], stdout=subprocess.PIPE, text=True)
c = socket.create_connection(("127.0.0.1", int(p.stdout.readline())))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
payload = bytes(n)
def raw_send():
    c.sendall(n.to_bytes(8, "little")); c.sendall(payload); c.recv(1, socket.MSG_WAITALL)
print("py->py raw TCP               33.5 MB up %.1f ms" % med(raw_send), flush=True)
c.close(); p.kill()
for name, o in OPTS.items():
    p = subprocess.Popen([sys.executable, "-c", srv, json.dumps([list(x) for x in BASE + o])], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    ch = grpc.insecure_channel("127.0.0.1:%d" % port, options=BASE + o)
    echo = ch.unary_unary("/e.E/Echo")
    up = (8).to_bytes(8, "little") + bytes(n)
    down = n.to_bytes(8, "little")
    print("py<->py %-22s 33.5 MB up %.1f ms, 33.5 MB down %.1f ms, tiny %.3f ms" % (
        name, med(lambda: echo(up)), med(lambda: echo(down)), med(lambda: echo((1).to_bytes(8, "little")), 50, 5)), flush=True)
    ch.close(); p.kill()

target = sys.argv[1]
B, T = 2048, 64
ids = np.arange(B, dtype=np.uint64)
for name, o in OPTS.items():
    ch = grpc.insecure_channel(target, options=BASE + o)
    st = pbg.RnnStub(ch)
    req = pb.ForwardRequest(recorded=pb.Recorded(env_ids=ids.tolist(), steps=T), reply_dtype=pb.BFLOAT16, recorded_fields=0)
    raw = ch.unary_unary("/rnnd.v1.Rnn/Forward", request_serializer=pb.ForwardRequest.SerializeToString, response_deserializer=None)
    t_raw = med(lambda: raw(req))
    b = raw(req)
    t_parse = med(lambda: pb.ForwardReply.FromString(b))
    print("py->rnnd %-22s Forward bf16 output only: call %.1f ms (raw bytes %d), parse %.1f ms" % (name, t_raw, len(b), t_parse), flush=True)
    ch.close()
