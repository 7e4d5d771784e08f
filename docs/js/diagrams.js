// The diagram renderer (3.5 MB) is loaded only by pages that have a diagram, before the theme
// draws them; the theme uses it instead of fetching one from a CDN. Written in while the page
// is parsed, so it runs before the page is ready.
if (document.querySelector("pre.mermaid")) {
  const renderer = new URL("mermaid/mermaid-11.17.2.min.js", document.currentScript.src);
  document.write(`<script src="${renderer.pathname}"></` + "script>");
}
