"""What plain TCP loopback carries on this host at rnndctl bench's message sizes: N connections,
each a closed loop of a request of ROWS x IN bytes answered by ROWS x OUT bytes (fp32 at I=64
H=128: 256 and 512 bytes a row; bf16: 128 and 256), between a client process of N threads and
a server process of N threads, nothing parsed. Prints the round trips a second as env-steps/s
(x ROWS) and the payload's GB/s: the ceiling any transport over loopback (gRPC's included) has
for `rnndctl bench --stream` at that load on this host.

Usage: python3 tests/gpu/loopback_ceiling.py [CONNECTIONS] [SECONDS] [PROCESSES]"""
import socket, subprocess, sys, threading, time

ROWS = 1024
SIZES = {"float32": (256, 512), "bfloat16": (128, 256)}

SERVER = r'''
import socket, sys, threading
n, inb, outb = (int(a) for a in sys.argv[1:4])
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(n); print(s.getsockname()[1], flush=True)
def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, reply = memoryview(bytearray(inb)), bytes(outb)
    while True:
        got = 0
        while got < inb:
            k = c.recv_into(buf[got:], inb - got)
            if k == 0: return
            got += k
        c.sendall(reply)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
'''

CLIENT = r'''
import socket, sys, threading, time
port, n, inb, outb, secs = (int(a) for a in sys.argv[1:6])
count = [0] * n
stop = time.perf_counter() + secs
def loop(i):
    c = socket.create_connection(("127.0.0.1", port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req, buf = bytes(inb), memoryview(bytearray(outb))
    while time.perf_counter() < stop:
        c.sendall(req); got = 0
        while got < outb: got += c.recv_into(buf[got:], outb - got)
        count[i] += 1
    c.close()
ts = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
for t in ts: t.start()
for t in ts: t.join()
print(sum(count) / secs, flush=True)
'''

def main():
    conns = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    secs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    procs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    for dtype, (inr, outr) in SIZES.items():
        inb, outb = ROWS * inr, ROWS * outr
        srv = subprocess.Popen([sys.executable, "-c", SERVER, str(conns), str(inb), str(outb)],
                               stdout=subprocess.PIPE, text=True)
        port = srv.stdout.readline().strip()
        cl = [subprocess.Popen([sys.executable, "-c", CLIENT, port, str(conns // procs), str(inb),
                                str(outb), str(secs)], stdout=subprocess.PIPE, text=True)
              for _ in range(procs)]
        rate = sum(float(c.communicate()[0]) for c in cl)
        srv.kill(); srv.wait()
        print("%s: %d connections from %d process(es), %d rows of %d + %d bytes a round trip: "
              "%.2fM env-steps/s, %.1f GB/s of payload" % (dtype, conns, procs, ROWS, inr, outr,
              rate * ROWS / 1e6, rate * (inb + outb) / 1e9), flush=True)

main()
