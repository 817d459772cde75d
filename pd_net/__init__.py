"""Network helpers shared by every role (router, decode server, the connector): a leaf
package, importing none of ours."""
