"""A real 2-node Ray cluster on loopback, running a command.

  python tests/scaleout_ray.py OUT.json CMD...


Starts `ray.cluster_utils.Cluster` (a head and one more node: two raylets, one CPU each),
runs CMD with `--ray_address=<the cluster>` appended, samples the listening TCP sockets of
every process of the cluster meanwhile, and writes OUT.json: the nodes' addresses and ids,
the listening addresses seen, CMD's exit code. Run in a subprocess with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray then registers nodes on 127.0.0.1) and HOME at a
temporary directory (Ray's token file goes there).
"""

import json
import os
import subprocess
import sys
import time

import ray
from ray.cluster_utils import Cluster

import scaleout_net

NODE = dict(num_cpus=1, object_store_memory=80 << 20)


def main(out: str, command: list[str]) -> None:
  cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
  try:
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    nodes = [{"address": n["NodeManagerAddress"], "id": n["NodeID"]}
             for n in ray.nodes() if n["Alive"]]
    ray.shutdown()
    process = subprocess.Popen(command + [f"--ray_address={cluster.address}"])
    listening = set()
    while process.poll() is None:
      listening |= scaleout_net.listening_addresses(scaleout_net.descendants(os.getpid()))
      time.sleep(0.5)
    with open(out, "w") as f:
      json.dump({"nodes": nodes, "listening": sorted(listening), "returncode": process.returncode,
                 "address": cluster.address}, f)
  finally:
    cluster.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
