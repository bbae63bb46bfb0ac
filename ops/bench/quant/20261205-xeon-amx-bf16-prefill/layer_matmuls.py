import time, torch
from ferry.kernels.quant_ref import quantize, dequantize
from ferry.kernels.quant_linear import quant_matmul, pack_cpu
torch.set_num_threads(2)
def t(f, n=10):
    f(); f()
    s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e3
shapes=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
ws=[]
for N,K in shapes:
    qw=quantize(torch.randn(N,K),4,32); ws.append((qw,pack_cpu(qw),dequantize(qw).to(torch.bfloat16)))
for M in [16,64,256,1024,2048]:
    xs={K: torch.randn(M,K) for K in (576,1536)}
    tq=sum(t(lambda: quant_matmul(xs[qw.in_features], qw, packed=p)) for qw,p,_ in ws)
    tc=sum(t(lambda: (xs[qw.in_features].to(torch.bfloat16)@wb.T).float()) for qw,_,wb in ws)
    to=sum(t(lambda: (xs[qw.in_features].to(torch.bfloat16)@dequantize(qw,torch.bfloat16).T).float()) for qw,_,_ in ws)
    print(f"M={M}: layer matmuls: quant kernel {tq:.2f} ms  bf16 cached {tc:.2f} ms  bf16 on-the-fly {to:.2f} ms")
