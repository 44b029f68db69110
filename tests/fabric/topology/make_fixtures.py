#!/usr/bin/env python3
"""Writes the topology fixtures of tests/fabric/topology_test.cc: hwloc XML files (as
`lstopo --of xml` would write them, reduced to what the rail choice reads) and the fi_info
lists to match ("<provider> <domain> <pci bus id>"), from the documented node layouts:

- p5en: 2 sockets, 8 H200, 16 EFA; each GPU under its own PCIe switch with 2 EFA devices
  (NIXL's LIBFABRIC backend maps each GPU to those 2 of the 16 rails).
- p4d: 2 sockets, 8 A100, 4 EFA; one EFA device under each switch with 2 GPUs.
- DGX H100: 2 sockets, 8 H100, 8 ConnectX-7; one NIC under each GPU's switch.

Each socket is one NUMA node; every switch hangs from its own root port and host bridge, so
NICs of another switch on the same socket are "same NUMA node", not "same switch". p5en also
has the management ENA device (not an EFA device, not in the fi_info list) on socket 0.

Run from anywhere: python3 make_fixtures.py (rewrites the files beside it).
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))

GPU_H200 = ("0302", "10de:2335")
GPU_H100 = ("0302", "10de:2330")
GPU_A100 = ("0302", "10de:20b0")
EFA = ("0200", "1d0f:efa1")
ENA = ("0200", "1d0f:ec20")
CX7 = ("0207", "15b3:1021")


class Writer:
    def __init__(self):
        self.gp = 0
        self.lines = []

    def gp_index(self):
        self.gp += 1
        return self.gp

    def add(self, depth, text):
        self.lines.append("  " * depth + text)


def pcidev(w, depth, bus, dev_class):
    cls, ids = dev_class
    w.add(depth, f'<object type="PCIDev" gp_index="{w.gp_index()}" pci_busid="0000:{bus:02x}:00.0" '
                 f'pci_type="{cls} [{ids}] [{ids}] 00" pci_link_speed="32.000000"/>')


def switch(w, depth, base, devices):
    """Host bridge -> root port -> switch upstream port -> one downstream port per device."""
    last = base + 3 + len(devices)
    w.add(depth, f'<object type="Bridge" gp_index="{w.gp_index()}" bridge_type="0-1" depth="0" '
                 f'bridge_pci="0000:[{base:02x}-{last:02x}]">')
    w.add(depth + 1, f'<object type="Bridge" gp_index="{w.gp_index()}" bridge_type="1-1" depth="1" '
                     f'bridge_pci="0000:[{base + 1:02x}-{last:02x}]" pci_busid="0000:{base:02x}:01.0" '
                     f'pci_type="0604 [8086:0db0] [0000:0000] 00" pci_link_speed="32.000000">')
    w.add(depth + 2, f'<object type="Bridge" gp_index="{w.gp_index()}" bridge_type="1-1" depth="2" '
                     f'bridge_pci="0000:[{base + 2:02x}-{last:02x}]" pci_busid="0000:{base + 1:02x}:00.0" '
                     f'pci_type="0604 [1000:c030] [0000:0000] 00" pci_link_speed="32.000000">')
    for n, dev in enumerate(devices):
        bus = base + 3 + n
        w.add(depth + 3, f'<object type="Bridge" gp_index="{w.gp_index()}" bridge_type="1-1" depth="3" '
                         f'bridge_pci="0000:[{bus:02x}-{bus:02x}]" pci_busid="0000:{base + 2:02x}:{n:02x}.0" '
                         f'pci_type="0604 [1000:c030] [0000:0000] 00" pci_link_speed="32.000000">')
        pcidev(w, depth + 4, bus, dev)
        w.add(depth + 3, "</object>")
    w.add(depth + 2, "</object>")
    w.add(depth + 1, "</object>")
    w.add(depth, "</object>")
    return [(base + 3 + n, dev) for n, dev in enumerate(devices)]


def machine(name, sockets, nic_name, provider, mgmt=None):
    """sockets: per socket, a list of switches, each a list of device classes; mgmt: a device
    on socket 0's own host bridge (bus 0). Returns the XML and the fi_info list."""
    w = Writer()
    w.add(0, '<?xml version="1.0" encoding="UTF-8"?>')
    w.add(0, '<!DOCTYPE topology SYSTEM "hwloc2.dtd">')
    w.add(0, '<topology version="2.0">')
    ncpu = 4
    all_cpus = (1 << (ncpu * len(sockets))) - 1
    all_nodes = (1 << len(sockets)) - 1
    w.add(1, f'<object type="Machine" os_index="0" cpuset="0x{all_cpus:08x}" complete_cpuset="0x{all_cpus:08x}" '
             f'allowed_cpuset="0x{all_cpus:08x}" nodeset="0x{all_nodes:08x}" complete_nodeset="0x{all_nodes:08x}" '
             f'allowed_nodeset="0x{all_nodes:08x}" gp_index="{w.gp_index()}">')
    w.add(2, f'<info name="DMIProductName" value="{name} (ferry test fixture)"/>')
    nics = []
    base = 0x10
    for s, switches in enumerate(sockets):
        cpus = ((1 << ncpu) - 1) << (ncpu * s)
        node = 1 << s
        sets = (f'cpuset="0x{cpus:08x}" complete_cpuset="0x{cpus:08x}" nodeset="0x{node:08x}" '
                f'complete_nodeset="0x{node:08x}"')
        w.add(2, f'<object type="Package" os_index="{s}" {sets} gp_index="{w.gp_index()}">')
        w.add(3, f'<object type="NUMANode" os_index="{s}" {sets} gp_index="{w.gp_index()}" local_memory="1073741824"/>')
        for c in range(ncpu):
            cpu = 1 << (ncpu * s + c)
            one = (f'cpuset="0x{cpu:08x}" complete_cpuset="0x{cpu:08x}" nodeset="0x{node:08x}" '
                   f'complete_nodeset="0x{node:08x}"')
            w.add(3, f'<object type="Core" os_index="{ncpu * s + c}" {one} gp_index="{w.gp_index()}">')
            w.add(4, f'<object type="PU" os_index="{ncpu * s + c}" {one} gp_index="{w.gp_index()}"/>')
            w.add(3, "</object>")
        if mgmt and s == 0:
            w.add(3, f'<object type="Bridge" gp_index="{w.gp_index()}" bridge_type="0-1" depth="0" '
                     f'bridge_pci="0000:[00-00]">')
            pcidev(w, 4, 0, mgmt)
            w.add(3, "</object>")
        for devices in switches:
            for bus, dev in switch(w, 3, base, devices):
                if dev in (EFA, CX7):
                    nics.append((bus, dev))
            base += 0x10
        w.add(2, "</object>")
    w.add(1, "</object>")
    w.add(0, "</topology>")
    listing = [f"# fi_info list of the {name} fixture: provider, domain name, nic->bus_attr (PCI)"]
    for i, (bus, _) in enumerate(nics):
        listing.append(f"{provider} {nic_name(i, bus)} 0000:{bus:02x}:00.0")
    return "\n".join(w.lines) + "\n", "\n".join(listing) + "\n"


def write(stem, xml, listing):
    with open(os.path.join(HERE, stem + ".xml"), "w") as f:
        f.write(xml)
    with open(os.path.join(HERE, stem + ".nics"), "w") as f:
        f.write(listing)


def efa_name(i, bus):
    return f"rdmap{bus}s0"  # the efa driver names a device after its PCI bus (decimal)


def main():
    p5en_socket = [[GPU_H200, EFA, EFA] for _ in range(4)]
    xml, nics = machine("p5en.48xlarge-like", [p5en_socket, p5en_socket], efa_name, "efa",
                        mgmt=ENA)
    write("p5en", xml, nics)

    p4d_socket = [[GPU_A100, GPU_A100, EFA] for _ in range(2)]
    xml, nics = machine("p4d.24xlarge-like", [p4d_socket, p4d_socket], efa_name, "efa")
    write("p4d", xml, nics)

    dgx_socket = [[GPU_H100, CX7] for _ in range(4)]
    xml, nics = machine("DGX H100-like", [dgx_socket, dgx_socket], lambda i, bus: f"mlx5_{i}",
                        "verbs;ofi_rxm")
    write("dgx_h100", xml, nics)


if __name__ == "__main__":
    main()
