# Mimics serving load beside the engine: wakes every 5 ms and burns ~0.5 ms (about 10% of one core), like the
# gateway/client/NATS waking per token batch.
import sys
import time

end = time.time() + float(sys.argv[1])
busy = 0.0
while time.time() < end:
    time.sleep(0.005)
    t = time.perf_counter()
    while time.perf_counter() - t < 0.0005:
        pass
    busy += 0.0005
print(f"noise busy {busy:.2f} s", file=sys.stderr)
