"""One worker over several ranks (devices or CPU processes): expert parallelism for DeepSeek-V4's MoE layers with
data-parallel attention, DeepSeek's serving layout.

    group.py      the process group: init from rank / world / address, gloo on a CPU, NCCL on CUDA; the few
                  collectives the rest uses (count exchange, all-to-all, broadcast of bytes, p2p batches)
    placement.py  which logical expert every physical slot holds (ExpertPlan's layout), pure: routing tables,
                  the slots a rank holds, the expert transfers a new placement needs
    ep_moe.py     the expert-parallel MoE: dispatch each (row, expert) pair to the rank holding a slot of that
                  expert, compute there, combine back; applying a new placement between two steps
    dp.py         the step driver: rank 0 schedules and broadcasts each step's plan, every rank runs its own
                  sequences' attention, ranks with no sequences still join every MoE exchange
    servers.py    what serving runs today (Engine(expert_parallel=N)): rank 0 is the whole engine, the ranks it
                  spawns hold their share of the experts and join every forward's exchanges; plans applied
"""
