"""A networkx view of an FX graph, for the dependency questions the matchers ask.

Built once per graph and refreshed after each rewrite. Edges go from a node to its users;
``depends(a, b)`` asks whether ``a`` needs ``b`` to have run.
"""

from __future__ import annotations

import networkx as nx
from torch.fx import Graph, Node


class DepGraph:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.refresh()

    def refresh(self):
        g = nx.DiGraph()
        for node in self.graph.nodes:
            g.add_node(node)
            for inp in node.all_input_nodes:
                g.add_edge(inp, node)
        self.g = g
        self._anc: dict[Node, set[Node]] = {}

    def ancestors(self, node: Node) -> set[Node]:
        if node not in self._anc:
            self._anc[node] = nx.ancestors(self.g, node)
        return self._anc[node]

    def depends(self, a: Node, b: Node) -> bool:
        """True if ``a`` (transitively) uses the result of ``b``."""
        return b in self.ancestors(a)

    def depends_on_any(self, a: Node, bs) -> Node | None:
        anc = self.ancestors(a)
        for b in bs:
            if b in anc:
                return b
        return None

    def would_cycle(self, inputs: list[Node], outputs: list[Node]) -> bool:
        """Would fusing ``outputs`` into one step that needs all ``inputs`` create a cycle?

        It would if some input depends on some output: the fused step would then wait on
        its own result.
        """
        outs = set(outputs)
        return any(self.ancestors(i) & outs or i in outs for i in inputs)

    def is_dag(self) -> bool:
        return nx.is_directed_acyclic_graph(self.g)
